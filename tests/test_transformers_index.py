"""megarl keeps transformers' lazy-import index on disk (megarl/runtime/transformers_index.py): the first process
that imports transformers writes it, later ones read it instead of parsing every model file, and what they read is
exactly what transformers computes. Each case runs in a fresh interpreter, as a worker process would."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path


def python(code: str, cache: Path, **env: str) -> str:
    full_env = {**os.environ, "MEGARL_CACHE_DIR": str(cache), **env}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


USE = "import megarl, transformers\nprint(transformers.__version__, transformers.AutoConfig.__name__)"


def test_the_first_import_writes_the_index_and_later_ones_read_it(tmp_path):
    import transformers

    assert python(USE, tmp_path) == f"{transformers.__version__} AutoConfig"
    index = tmp_path / f"transformers-index-{transformers.__version__}.pkl"
    written = index.stat().st_mtime_ns
    (version, package, _), entries = pickle.loads(index.read_bytes())
    assert version == transformers.__version__ and package == str(Path(transformers.__file__).resolve().parent)
    models = (str(Path(package) / "models"), "models")
    assert models in entries  # the big one: every model family
    assert python(USE, tmp_path) == f"{transformers.__version__} AutoConfig"
    assert index.stat().st_mtime_ns == written  # answered from the file: nothing computed, nothing written

    # what the file holds is what transformers computes itself (the hook off)
    fresh = python(
        "import pickle, sys, megarl\n"
        "from pathlib import Path\n"
        "import transformers.utils.import_utils as iu\n"
        f"structure = iu.define_import_structure(Path({models[0]!r}), prefix='models')\n"
        "sys.stdout.buffer.write(pickle.dumps(structure).hex().encode())",
        tmp_path / "unused",
        MEGARL_NO_TRANSFORMERS_INDEX="1",
    )
    assert pickle.loads(bytes.fromhex(fresh)) == entries[models]


def test_an_index_of_another_installation_is_recomputed(tmp_path):
    import transformers

    index = tmp_path / f"transformers-index-{transformers.__version__}.pkl"
    index.write_bytes(pickle.dumps(((transformers.__version__, "/elsewhere/transformers", 0), {"stale": 1})))
    assert python(USE, tmp_path) == f"{transformers.__version__} AutoConfig"
    stamp, entries = pickle.loads(index.read_bytes())
    assert stamp[1] == str(Path(transformers.__file__).resolve().parent) and "stale" not in entries
