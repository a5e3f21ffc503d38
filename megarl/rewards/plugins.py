"""Find the reward function that `reward.fn` names: a built-in, `module.path:function` or `path/to/file.py:function`.

Everything here runs when the config is validated, before Ray or any model starts, so a typo costs seconds. Worker
processes load the function again from its name (functions of a file-loaded module cannot be pickled by reference).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from megarl.errors import UserError
from megarl.rewards.builtin import BUILTIN_REWARDS
from megarl.rewards.types import RewardFn

_SPEC_FORMS = "a built-in name, 'module.path:function' or 'path/to/file.py:function'"


def is_file_spec(spec: str) -> bool:
    """Whether `spec` names a function in a Python file (rather than in an importable module)."""
    target = spec.rpartition(":")[0]
    return target.endswith(".py") or "/" in target or os.sep in target


def absolute_spec(spec: str) -> str:
    """`spec` with a file path made absolute, so that processes started elsewhere find the same file."""
    if ":" not in spec or not is_file_spec(spec):
        return spec
    target, _, name = spec.rpartition(":")
    return f"{Path(target).expanduser().resolve()}:{name}"


def load_reward_fn(spec: str, key: str = "reward.fn") -> RewardFn:
    """The callable that `spec` names; raises UserError naming `key`, what is wrong and what would be valid."""
    if ":" not in spec:
        if spec in BUILTIN_REWARDS:
            return BUILTIN_REWARDS[spec].fn
        close = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(
            f"{key}={spec!r} is not a built-in reward function; valid: {', '.join(sorted(BUILTIN_REWARDS))}, or "
            f"'module.path:function' / 'path/to/file.py:function'{hint}"
        )
    fn = load_object(spec, key)
    if not callable(fn):
        raise UserError(
            f"{key}={spec!r}: {spec.rpartition(':')[2]} is a {type(fn).__name__}, not a callable reward function"
        )
    return fn


def load_object(spec: str, key: str, kind: str = "functions") -> Any:
    """What `spec` ('module.path:name' or 'path/to/file.py:name') names; UserError naming `key` otherwise, listing
    the module's public `kind` ("functions" or "classes") as the valid choices."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise UserError(f"{key}={spec!r} must be {_SPEC_FORMS}")
    module = _load_file(target, spec, key) if is_file_spec(spec) else _import_module(target, spec, key)
    if not hasattr(module, name):
        wanted = inspect.isclass if kind == "classes" else inspect.isfunction
        choices = sorted(n for n, v in vars(module).items() if wanted(v) and not n.startswith("_"))
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(
            f"{key}={spec!r}: {target} has no attribute {name!r}; its {kind}: {', '.join(choices) or 'none'}{hint}"
        )
    return getattr(module, name)


def check_reward_fn(spec: str, kwargs: Mapping[str, Any], key: str) -> None:
    """Load the function that `{key}.fn` names and check that it accepts `(samples, **{key}.kwargs)`."""
    fn = load_reward_fn(spec, key=f"{key}.fn")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none: nothing to check
        signature = None
    if signature is not None:
        try:
            signature.bind(None, **kwargs)
        except TypeError as error:
            raise UserError(
                f"{key}.kwargs={dict(kwargs)!r} does not fit reward function {spec}{_bare(signature)}: {error}; it "
                "is called as fn(samples, **kwargs)"
            ) from None
    if spec in BUILTIN_REWARDS:
        BUILTIN_REWARDS[spec].check_kwargs(dict(kwargs), f"{key}.kwargs")


def _bare(signature: inspect.Signature) -> inspect.Signature:
    """The signature without annotations, short enough for an error message."""
    parameters = [parameter.replace(annotation=inspect.Parameter.empty) for parameter in signature.parameters.values()]
    return signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty)


def _import_module(target: str, spec: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as error:
        if error.name and (target == error.name or target.startswith(error.name + ".")):
            raise UserError(
                f"{key}={spec!r}: no module named {error.name!r} (searched sys.path, which starts with the working "
                f"directory {os.getcwd()}); give an installed module or a file path 'path/to/file.py:function'"
            ) from None
        raise UserError(f"{key}={spec!r}: importing {target} failed: {error} (a module it imports)") from error
    except Exception as error:
        raise UserError(f"{key}={spec!r}: importing {target} raised {type(error).__name__}: {error}") from error


def _load_file(target: str, spec: str, key: str) -> ModuleType:
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        where = (
            ""
            if os.path.isabs(target)
            else " (a relative path on the command line starts at the working directory, one in a config file at the "
            "file's folder)"
        )
        raise UserError(f"{key}={spec!r}: file {path} does not exist{where}")
    # One module per file, registered under a stable name so that loading twice reuses it and pickle finds it.
    module_name = f"megarl_reward_plugin_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}_{path.stem}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise UserError(f"{key}={spec!r}: running {path} raised {type(error).__name__}: {error}") from error
    return module
