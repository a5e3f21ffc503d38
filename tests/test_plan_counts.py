"""The planner's parameter counts equal those of meta-device Megatron models built by megarl's builder, for the
whole model (TP=1) and for each rank's share at TP/PP/VPP/EP/ETP layouts (local spec, as on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.plan.model_size import count_parameters, hf_config_from_dict, model_shape, stage_params
from megarl.runtime.parallel import ParallelConfig as P

REPO = Path(__file__).resolve().parents[1]


def shape_of(name: str, spec_backend: str = "te"):
    raw = json.loads((REPO / "configs" / "models" / f"{name}.json").read_text())
    return model_shape(hf_config_from_dict(raw), spec_backend)


def megatron_counts(name: str, parallel: P) -> tuple[int, int]:
    """Rank side: (pipeline rank, parameters of this rank's meta-device model chunks) at `parallel`."""
    from megatron.core import parallel_state as ps

    from megarl.bridge.mappings import VocabInfo, pad_vocab_size
    from megarl.models.builder import build_model
    from megarl.models.registry import get_architecture
    from megarl.plan.model_size import hf_config_from_dict
    from megarl.runtime.distributed import init_model_parallel
    from megarl.testing.tiny_checkpoint import tiny_config

    init_model_parallel(parallel)
    config = hf_config_from_dict(tiny_config(name))
    vocab = VocabInfo(config.vocab_size, pad_vocab_size(config.vocab_size, 128, parallel.tp))
    chunks = build_model(get_architecture(config.model_type), config, parallel, vocab, meta=True, spec_backend="local")
    return ps.get_pipeline_model_parallel_rank(), sum(p.numel() for chunk in chunks for p in chunk.parameters())


TINY = ["tiny-llama", "tiny-llama-bias", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral", "tiny-qwen3-moe"]
TINY += ["tiny-deepseek-v3", "tiny-deepseek-v3-lite", "tiny-glm4-moe", "tiny-gpt-oss"]
TINY += ["tiny-qwen3-next", "tiny-qwen3.5-moe"]  # Gated DeltaNet layers, gated attention, a gated shared expert


@pytest.mark.parametrize("name", TINY)
def test_whole_model_count_equals_megatron(ranks1, name):
    ((_, megatron),) = ranks1.run(megatron_counts, name, P())
    assert count_parameters(shape_of(name, "local")) == megatron


@pytest.mark.parametrize(
    "name, parallel",
    [
        ("tiny-llama", P(tp=2, pp=2)),
        ("tiny-qwen2", P(tp=2, pp=2)),  # tied embeddings: the last stage keeps its own output layer
        ("tiny-mixtral", P(tp=2, ep=2)),
        ("tiny-qwen3-moe", P(tp=2, ep=4, etp=1)),
        ("tiny-deepseek-v3", P(tp=2, pp=2, ep=2, etp=1)),
        ("tiny-deepseek-v3-lite", P(tp=2, vpp=2, pp=2)),
        ("tiny-gpt-oss", P(tp=2, pp=2, ep=2, etp=1)),  # sinks split by heads, expert biases
        ("tiny-qwen3-next", P(tp=2, pp=2, ep=2, etp=1)),  # GDN projections split by key heads
    ],
    ids=lambda v: v if isinstance(v, str) else f"tp{v.tp}-pp{v.pp}-vpp{v.vpp}-ep{v.ep}-etp{v.etp}",
)
def test_rank_share_equals_megatron(ranks4, name, parallel):
    shape = shape_of(name, "local")
    etp = parallel.etp if parallel.etp is not None else parallel.tp
    for stage, megatron in ranks4.run(megatron_counts, name, parallel):
        ours = stage_params(
            shape, tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp, ep=parallel.ep, etp=etp, stage=stage
        )
        assert ours.total == megatron, (stage, ours, megatron)
