"""Load a HF checkpoint's tensors into SGLang's own model class on CPU, one weight-sync bucket per `load_weights`
call, and report what SGLang did not take. Run as a script (its own process: SGLang sets process-wide state):

    python tests/sglang_load_check.py MODEL_DIR [--one-by-one] [--fp8]
    python tests/sglang_load_check.py MODEL_DIR --read-folder SYNC_DIR

Prints one JSON line: {"params": N, "no_effect": [names whose load changed no parameter],
"unwritten": [SGLang parameters no tensor wrote]}. Buckets are formed as megarl's weight sync forms them at a 1-byte
budget (every tensor alone, except the groups an engine fuses at load time: Architecture.load_groups);
--one-by-one loads every tensor alone instead (what SGLang sees when the groups are ignored). --fp8 builds the model
with SGLang's own Fp8Config of DeepSeek-V3's quantization_config (8 x 8 blocks) and loads each bucket as megarl's
sender makes it for rollout.weights_format=fp8 (megarl.bridge.fp8.quantize_bucket). --read-folder reads a disk-sync
folder with SGLang's own DefaultModelLoader, as update_weights_from_disk does, and prints {name: [dtype, shape,
sum as float64]} of what it yields.

    python tests/sglang_load_check.py --serve

imports SGLang's model classes once (the check's fixed cost, ~20 s of imports) and then runs one check per line read
from stdin (`{"argv": [MODEL_DIR, ...flags], "out": RESULT_FILE}`), each in a child forked from the imported process
(the process-wide state SGLang sets stays in the child), writing the child's JSON line to RESULT_FILE and `{"rc": N}`
to stdout when the child is done.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import sglang_contract

OFFICIAL_DEEPSEEK_V3_KEYS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "ep_size": 1}
"""Keys of DeepSeek-V3's published config.json that SGLang reads and transformers' DeepseekV3Config does not
define: the tiny checkpoints (saved from that class) lack them."""

SGLANG_CONFIG_CLASSES = {
    "qwen3_next": ("sglang.srt.configs.qwen3_next", "Qwen3NextConfig"),
    "qwen3_5_moe_text": ("sglang.srt.configs.qwen3_5", "Qwen3_5MoeTextConfig"),
}
"""Families whose SGLang model reads SGLang's own config class (the hybrid GDN layers' `layers_block_type`), as
SGLang's config registry gives it for these model_types."""


def build_sglang_model(model_dir: str, quantization: dict | None = None, tp: int = 1, rank: int = 0):
    """SGLang's model class for the checkpoint, on CPU; `tp` > 1: this process is rank `rank` of a gloo world of
    `tp` processes (MASTER_ADDR / MASTER_PORT set alike in all)."""
    import torch

    from megarl.models.hf_config import load_hf_config

    sglang_contract.install_stand_ins()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    from sglang.srt.distributed import parallel_state
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    # Kimi K2's model_type is read as DeepSeek-V3's config, as SGLang gets it from the checkpoint's own remote code
    config = load_hf_config(model_dir)
    # one process as SGLang's own layer tests set it up (world of 1, tp = pp = ep = 1). The model is built on CPU
    # tensors; SGLang's device setting only picks code paths: "cuda" (kernels referenced, never run) except where
    # SGLang's GPU rotary embedding checks for a GPU (yarn RoPE), whose CPU path in turn requires a rope scaling
    rope_scaling = getattr(config, "rope_scaling", None) or {}
    device = "cpu" if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default" else "cuda"
    # Qwen3-Next's and Qwen3.5's GDN layers: SGLang's default mamba cache snapshots need a GPU platform; its
    # no_buffer strategy runs without the overlap schedule
    hybrid = {"mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True}
    extra = hybrid if config.model_type in SGLANG_CONFIG_CLASSES else {}
    server_args = ServerArgs(model_path=model_dir, device=device, dtype="float32", tp_size=tp, **extra)
    parallel_state.init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo")
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")
    set_global_server_args_for_scheduler(server_args)

    if config.model_type == "deepseek_v3":
        for key, value in OFFICIAL_DEEPSEEK_V3_KEYS.items():
            if not hasattr(config, key):
                setattr(config, key, value)
    if config.model_type in SGLANG_CONFIG_CLASSES:  # SGLang's own config class: layer kinds from
        # full_attention_interval
        import importlib

        module, cls = SGLANG_CONFIG_CLASSES[config.model_type]
        config = getattr(importlib.import_module(module), cls).from_pretrained(model_dir)
    model_cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    torch.set_default_dtype(torch.float32)
    if quantization is None:
        return model_cls(config)
    from sglang.srt.layers.quantization import get_quantization_config

    config.quantization_config = quantization
    return model_cls(config, quant_config=get_quantization_config("fp8").from_config(quantization))


def buckets_of(model_dir: str, tensors: dict, one_by_one: bool) -> list[list[tuple[str, object]]]:
    from megarl.bridge.buckets import BucketBuilder, travel_groups
    from megarl.models.hf_config import read_config_json
    from megarl.models.registry import get_architecture

    arch = get_architecture(read_config_json(model_dir).get("model_type"))
    builder = BucketBuilder(1, None if one_by_one else travel_groups(tensors, arch.load_groups))
    buckets = [b for name, tensor in tensors.items() if (b := builder.add(name, tensor))]
    return [*buckets, builder.flush()]


def read_folder(model_dir: str, folder: str) -> None:
    import torch

    sglang_contract.install_stand_ins()
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path=model_dir, device="cpu"))
    loader = DefaultModelLoader(LoadConfig(load_format="auto"))
    weights = loader._get_weights_iterator(DefaultModelLoader.Source(folder, None))
    found = {n: [str(t.dtype), list(t.shape), t.to(torch.float64).sum().item()] for n, t in weights}
    print(json.dumps(found))


def main() -> None:
    import torch
    from safetensors.torch import load_file

    if "--read-folder" in sys.argv:
        return read_folder(sys.argv[1], sys.argv[sys.argv.index("--read-folder") + 1])

    from megarl.bridge.fp8 import DEEPSEEK_QUANTIZATION, BlockFP8, quantize_bucket

    model_dir, one_by_one, fp8 = sys.argv[1], "--one-by-one" in sys.argv, "--fp8" in sys.argv
    # SGLang's block-FP8 layers need every projection's width divisible by the block: the tiny models' widths are
    # multiples of 8 (DeepSeek-V3's of 128), so the check quantizes in 8 x 8 blocks
    quantization = dict(DEEPSEEK_QUANTIZATION, weight_block_size=[8, 8])
    model = build_sglang_model(model_dir, quantization if fp8 else None)
    params = dict(model.named_parameters())
    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    marker = 0xA5  # every byte of every parameter, FP8 ones included; no loaded tensor is all 0xA5 bytes
    with torch.no_grad():
        for param in params.values():
            param.reshape(-1).view(torch.uint8).fill_(marker)

    def snapshot() -> dict[str, torch.Tensor]:
        return {name: p.detach().reshape(-1).view(torch.uint8).clone() for name, p in params.items()}

    no_effect, dtypes = [], {}
    buckets = buckets_of(model_dir, tensors, one_by_one)
    if fp8:
        buckets = [quantize_bucket(bucket, BlockFP8.from_config(quantization, "test")) for bucket in buckets]
    for bucket in buckets:
        dtypes.update({name: str(t.dtype) for name, t in bucket})
        before = snapshot()
        model.load_weights(iter(bucket))
        after = snapshot()
        if all(torch.equal(before[n], after[n]) for n in params):
            no_effect += [name for name, _ in bucket]
    unwritten = [name for name, p in params.items() if (p.detach().reshape(-1).view(torch.uint8) == marker).all()]
    fp8_params = sorted(name for name, p in params.items() if p.dtype == torch.float8_e4m3fn)
    print(
        json.dumps(
            {
                "params": len(params),
                "no_effect": sorted(no_effect),
                "unwritten": sorted(unwritten),
                "fp8_params": fp8_params,
                "sent_dtypes": dtypes,
            }
        )
    )


def serve() -> None:
    """Import once, fork per check (see the module docstring). Single-threaded torch (OMP_NUM_THREADS=1, set by the
    caller) so no thread pool exists at the fork."""
    sglang_contract.install_stand_ins()
    import safetensors.torch  # noqa: F401
    import sglang.srt.distributed.parallel_state
    import sglang.srt.layers.quantization
    import sglang.srt.model_loader.loader
    import sglang.srt.models.registry  # noqa: F401  every model class: most of the import time
    import transformers  # noqa: F401

    import megarl.bridge.buckets
    import megarl.bridge.fp8  # noqa: F401

    for line in sys.stdin:
        job = json.loads(line)

        def check(job=job) -> None:  # in the child: one check, its JSON line to the result file
            with open(job["out"], "w") as out:
                os.dup2(out.fileno(), 1)
                sys.argv = [sys.argv[0], *job["argv"]]
                main()

        pid = sglang_contract.fork_child(check)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["--serve"] else main()
