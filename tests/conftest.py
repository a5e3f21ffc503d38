"""Shared fixtures: long-lived gloo rank pools and tiny HF checkpoints built once per session; and the suite's
parallel workers.

Rank-side functions live in the test modules; the pools' spawned processes import them by module name, so this
folder is put on sys.path before any pool starts.

With pytest-xdist installed (the dev extra), `python -m pytest tests -q -n N` runs on N worker processes, a test file
whole on one worker (`--dist loadfile`: module-scoped runs and pools are shared as written); XDIST_WORKERS sets the
default. The GPU kit loads no plugin it does not name (PYTEST_DISABLE_PLUGIN_AUTOLOAD), so its
runs stay in one process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from megarl.runtime.rank_pool import RankPool
from megarl.testing.tiny_checkpoint import make_hf_checkpoint

XDIST_WORKERS = 0
"""Workers by default; 0: the suite runs in one process. On the 2-core CI machine two workers made the suite slower
(82 min against 45 in one process: two Ray instances and rank pools fighting for the cores, start-up deadlines
missed); a bigger machine gains from `-n 4`."""


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """XDIST_WORKERS workers and whole files per worker by default (see the module docstring). Not in pyproject's
    addopts: there `-n` would be an unknown option wherever pytest-xdist is not loaded (the GPU kit)."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput") or config.option.collectonly:
        return
    if config.option.numprocesses is None and XDIST_WORKERS:
        config.option.numprocesses = XDIST_WORKERS
    if config.option.numprocesses and config.option.dist == "no":
        config.option.dist = "loadfile"  # module-scoped runs and pools stay on one worker


@pytest.fixture(scope="session", autouse=True)
def _megarl_cache(tmp_path_factory):
    """megarl's cache of passed checks (megarl/checkpoint/verify.py) in the session's temporary folder, not the
    home folder: for the tests and the `megarl train` processes they start."""
    os.environ["MEGARL_CACHE_DIR"] = str(tmp_path_factory.mktemp("megarl-cache"))
    yield
    del os.environ["MEGARL_CACHE_DIR"]


@pytest.fixture(scope="session")
def ranks4():
    """Four gloo ranks: enough for TP=2 x PP=2 (smaller layouts use the rest as data parallelism)."""
    with RankPool(4, timeout_s=300) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks1():
    """One rank with Megatron state of its own: offline conversion runs here, outside the pytest process."""
    with RankPool(1, timeout_s=300) as pool:
        yield pool


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name, dtype=torch.float32, max_shard_size=None) -> folder of a tiny saved HF model."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("hf")

    def make(name: str, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None) -> Path:
        key = (name, dtype, max_shard_size)
        if key not in cache:
            folder = root / f"{name}-{str(dtype).removeprefix('torch.')}-{max_shard_size or 'single'}"
            cache[key] = make_hf_checkpoint(name, folder, dtype=dtype, max_shard_size=max_shard_size)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory):
    """other_checkpoint(name) -> folder of the same architecture as hf_checkpoint(name) with different random weights
    (seed 1, no tokenizer): what a weight update writes into an engine loaded from hf_checkpoint(name)."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("hf-other")

    def make(name: str):
        if name not in cache:
            cache[name] = make_hf_checkpoint(name, root / name, seed=1, with_tokenizer=False)
        return cache[name]

    return make


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy shared CPU they lose a lot (a module's tests ask
    for it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="session")
def hf_reference(hf_checkpoint):
    """hf_reference(name, batch=2) -> (HF folder, token ids [batch, 48], the HF model's fp32 logits on them)."""
    from helpers import hf_logits, sample_ids

    cache: dict = {}

    def get(name: str, batch: int = 2):
        if (name, batch) not in cache:
            folder = hf_checkpoint(name)
            ids = sample_ids(vocab_size=1000, batch=batch, seq=48)
            cache[name, batch] = (folder, ids, hf_logits(folder, ids))
        return cache[name, batch]

    return get
