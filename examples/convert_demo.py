"""The conversion demo: HF checkpoints become Megatron-Core models at several parallel layouts, and come back.

    python examples/convert_demo.py [--workdir runs/convert_demo]

For a small dense Qwen3 and a small DeepSeek-V3 (MLA, 8 routed experts + 1 shared, group-limited sigmoid routing):
1. builds the checkpoint (bf16, random weights, local tokenizer) with transformers' save_pretrained;
2. `megarl convert --from hf --to mcore`: a Megatron distributed checkpoint (TP=2 x PP=2, resp. TP=2 x EP=2);
3. loads that checkpoint on 4 gloo ranks at other layouts and compares Megatron's logits with the HF model's;
4. `megarl convert --from mcore --to hf` and checks the result is bit-identical to the original checkpoint.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

MODELS = {
    "tiny-qwen3": (["--tp", "2", "--pp", "2"], [dict(tp=2, pp=2), dict(pp=2, vpp=2), dict(tp=2)]),
    "tiny-deepseek-v3": (["--tp", "2", "--ep", "2"], [dict(tp=2, ep=2), dict(ep=4), dict(tp=2, pp=2, ep=2, etp=1)]),
}


def megatron_logits(path: str, layout: dict, input_ids: torch.Tensor):
    """Runs on every rank: load the checkpoint at `layout`, return full logits from one last-stage rank."""
    from megatron.core import parallel_state as ps

    from megarl.checkpoint.model_io import load_model
    from megarl.models.pipeline import forward_logits
    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig

    parallel = ParallelConfig(**layout)
    init_model_parallel(parallel)
    model = load_model(path, parallel, torch.float32)
    logits = forward_logits(model.chunks, input_ids, model.vocab.size)
    reporting = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return logits if logits is not None and reporting else None


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def megarl_cli(*argv: str) -> None:
    print("$ megarl " + " ".join(argv), flush=True)
    subprocess.run([sys.executable, "-m", "megarl.cli", *argv], check=True)


def demo(name: str, workdir: Path, pool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.bridge.safetensors_io import HFCheckpoint
    from megarl.testing.tiny_checkpoint import make_hf_checkpoint

    flags, layouts = MODELS[name]
    hf_dir, mcore_dir, back_dir = workdir / name / "hf", workdir / name / "mcore", workdir / name / "hf_back"
    step(f"{name}: 1. a HF checkpoint (bf16) saved with save_pretrained")
    make_hf_checkpoint(name, hf_dir, dtype=torch.bfloat16, max_shard_size="200KB")
    print(f"{hf_dir}: {len(HFCheckpoint(hf_dir).names)} tensors in {len(list(hf_dir.glob('*.safetensors')))} files")

    step(f"{name}: 2. HF -> Megatron distributed checkpoint")
    megarl_cli("convert", "--from", "hf", "--to", "mcore", str(hf_dir), str(mcore_dir), *flags)

    step(f"{name}: 3. Megatron logits vs HF logits on 4 gloo ranks")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompts = ["megarl on a laptop: 12+30=42", "Megatron-Core runs on gloo too"]
    input_ids = tokenizer(prompts, return_tensors="pt", padding=True)["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(input_ids).logits.detach()
    for layout in layouts:
        logits = next(r for r in pool.run(megatron_logits, str(mcore_dir), layout, input_ids) if r is not None)
        diff = (logits - reference).abs().max().item()
        shown = " ".join(f"{axis.upper()}={size}" for axis, size in layout.items())
        print(f"{shown}: max |megatron - hf| = {diff:.2e}  {'ok' if diff < 1e-4 else 'MISMATCH'}")
        assert diff < 1e-4

    step(f"{name}: 4. Megatron -> HF, compared bit for bit with the original")
    megarl_cli("convert", "--from", "mcore", "--to", "hf", str(mcore_dir), str(back_dir))
    original, converted = HFCheckpoint(hf_dir), HFCheckpoint(back_dir)
    same = sorted(original.names) == sorted(converted.names) and all(
        torch.equal(original.get(n), converted.get(n)) and original.spec(n) == converted.spec(n) for n in original.names
    )
    print(f"{len(original.names)} tensors, names/dtypes/shapes/values identical: {same}")
    assert same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/convert_demo")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    start = time.monotonic()

    from megarl.runtime.rank_pool import RankPool

    with RankPool(4) as pool:
        for name in MODELS:
            demo(name, workdir, pool)
    print(f"\ndemo finished in {time.monotonic() - start:.0f} s; files in {workdir}")


if __name__ == "__main__":
    main()
