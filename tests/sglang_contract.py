"""The real SGLang package (sglang==0.5.23, installed without its CUDA dependencies by .ci/run) as a contract
checker on CPU: its ServerArgs parser, its request types, its flattened-bucket code and its model classes.

SGLang's modules import a few things that cannot be installed on a CPU machine: torchvision (for multimodal models,
pulled in by its config registry) and vllm's custom ops (a rotary-embedding fallback kernel referenced, never called,
when a model is built off CUDA). Those two are stood in for by empty modules, installed here only, and after
transformers has decided that torchvision is absent. Nothing of SGLang's own is replaced.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import pytest

SGLANG_VERSION = "0.5.23"
STOOD_IN = ("torchvision", "vllm")
INSTALL_HINT = f"pip install --no-deps sglang=={SGLANG_VERSION} (the test command in the README does)"


class _AnyAttribute(type):
    """A stand-in class: every attribute is another stand-in class (enum members, nested types)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyAttribute(name, (), {"__init__": lambda self, *a, **k: None})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _AnyAttribute(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        return None


class _StandInFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STOOD_IN and importlib.machinery.PathFinder.find_spec(name.split(".")[0]) is None:
            return importlib.machinery.ModuleSpec(name, _StandInLoader(), is_package=True)
        return None


def installed() -> bool:
    if importlib.util.find_spec("sglang") is None:
        return False
    from importlib.metadata import version

    return version("sglang") == SGLANG_VERSION


def install_stand_ins() -> None:
    """Make SGLang's modules importable here (see the module docstring); idempotent."""
    import transformers.utils.import_utils  # noqa: F401  decides torchvision's absence before a stand-in exists

    if not any(isinstance(finder, _StandInFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder())


def sglang_module(name: str) -> Any:
    """Import one of SGLang's modules (skips the test where the pinned SGLang is not installed)."""
    if not installed():
        pytest.skip(f"needs sglang=={SGLANG_VERSION}: {INSTALL_HINT}")
    install_stand_ins()
    return importlib.import_module(name)


# ---- SGLang's request types, as its HTTP server reads each body ----------------------------------------------------

REQUEST_TYPES = {
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/abort_request": "AbortReq",
}
"""Route -> the io_struct type its handler takes (sglang 0.5.23, srt/entrypoints/http_server.py)."""

NO_BODY = ("/health", "/health_generate", "/flush_cache", "/model_info", "/server_info")


def validate_request(path: str, body: Any) -> Any:
    """Build SGLang's own request object from a JSON body megarl sends to `path`; raises on any field SGLang does
    not know, a value of the wrong type, or an inconsistent /generate batch. Returns the object."""
    import msgspec

    io_struct = sglang_module("sglang.srt.managers.io_struct")
    if path in NO_BODY:
        assert body in (None, {}), f"{path} takes no body, megarl sent {body!r}"
        return None
    if path == "/generate":
        request = io_struct.GenerateReqInput(**body)  # a dataclass: unknown keys are a TypeError
        request.normalize_batch_and_arguments()
        sampling = sglang_module("sglang.srt.sampling.sampling_params")
        for params in (
            body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
        ):
            sampling.SamplingParams(**params).verify(vocab_size=2**31 - 1)  # as the tokenizer manager does
        return request
    cls = getattr(io_struct, REQUEST_TYPES[path])
    unknown = set(body) - set(cls.__struct_fields__)
    assert not unknown, f"{path}: {cls.__name__} has no field(s) {sorted(unknown)}"
    # msgspec checks every field's type on decoding (bytes travel as base64 text in JSON, as over HTTP)
    return msgspec.json.decode(msgspec.json.encode(cls(**body)), type=cls)


def fork_child(work) -> int:
    """Run `work()` in a forked child (SGLang's process-wide state stays in it); returns the child's pid. The child
    exits 0 when `work` returned, 1 with the traceback on stderr when it raised."""
    import os
    import traceback

    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            work()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    return pid
