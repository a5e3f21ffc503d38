"""megarl's import hook makes Megatron's `torch.compile` decorators lazy (megarl/runtime/lazy_compile.py): importing
Megatron no longer imports TorchDynamo/Inductor, and a decorated function is compiled, with its options, on its
first call, once."""

from __future__ import annotations

import subprocess
import sys

from megarl.runtime.lazy_compile import lazy


def test_compiles_on_the_first_call_once_with_the_decorators_options():
    compiled = []

    def fake_compile(fn, **options):
        compiled.append((fn.__name__, options))
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    decorator = lazy(fake_compile)

    @decorator
    def plain(x):
        return x + 1

    @decorator(dynamic=False)
    def with_options(x):
        return x * 2

    assert compiled == [] and plain.__name__ == "plain"  # nothing compiled at decoration
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_options(3) == ("compiled", 6)
    assert compiled == [("plain", {}), ("with_options", {"dynamic": False})]


def test_importing_megatron_through_megarl_leaves_dynamo_unimported():
    code = (
        "import sys, megarl, megatron.core, megatron.core.models.gpt, megatron.core.optimizer, megatron.core.jit\n"
        "from megatron.core.fusions import fused_bias_gelu\n"
        "print('torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules,"
        " megatron.core.jit.jit_fuser.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "megarl.runtime.lazy_compile"]
