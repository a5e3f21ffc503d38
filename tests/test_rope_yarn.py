"""YaRN RoPE for grouped-query attention (models/rope.py): Qwen3 / Qwen3-MoE long-context checkpoints
(`rope_type: yarn, factor: 4, original_max_position_embeddings: 32768`) and gpt-oss (`truncate: false`).

The frequencies and the attention factor equal transformers' `_compute_yarn_parameters`, the cosine and sine
tables its rotary embedding's, and a tiny Qwen3 with YaRN gives the HF model's logits through Megatron-Core at
TP = 1, TP = 2 and CP = 2 (gloo ranks: tests/conftest.py's four-rank pool).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import megatron_logits, one_result, sample_ids
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from megarl.models.hf_config import rope_parameters
from megarl.models.registry import get_architecture
from megarl.models.rope import attention_softmax_scale, rope_attention_factor, rope_inv_freq
from megarl.runtime.parallel import ParallelConfig

QWEN3_131K = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
YARN_CASES = {
    "qwen3-131k": (QWEN3_131K, 131072),
    "gpt-oss": (  # no rounding of the ramp's bounds, theta 150k
        {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "rope_theta": 150000.0,
         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        131072,
    ),
    "deepseek-mscale": (  # factor from max / original positions; mscale over mscale_all_dim
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
         "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 24, "beta_slow": 2},
        163840,
    ),
    "mscale-alone": (  # HF ignores mscale without mscale_all_dim
        {**QWEN3_131K, "mscale": 0.707},
        131072,
    ),
    "explicit-attention-factor": ({**QWEN3_131K, "attention_factor": 1.5}, 131072),
    "partial-rotary": ({**QWEN3_131K, "partial_rotary_factor": 0.5}, 131072),
}  # fmt: skip


def _config(rope: dict, max_positions: int) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=max_positions,
        rope_parameters=dict(rope),
    )


@pytest.mark.parametrize("case", YARN_CASES)
def test_frequencies_and_attention_factor_equal_transformers(case):
    config = _config(*YARN_CASES[case])
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = rope_parameters(config)
    rotary_dim = int(128 * rope.get("partial_rotary_factor", 1.0))
    inv_freq = rope_inv_freq(rotary_dim, rope, config.max_position_embeddings)
    assert inv_freq.shape == expected_inv_freq.shape
    assert torch.allclose(inv_freq, expected_inv_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(rope, config.max_position_embeddings) == pytest.approx(expected_factor, rel=1e-12)


def test_qwen3_131k_numbers():
    """Qwen3's published YaRN settings, by hand: attention factor 0.1 ln 4 + 1. Frequency pair i turns
    32768 / (2 pi 1e6^(i/64)) times over the original context: 32 turns at i = 23.6, 1 turn at i = 39.6, so pairs
    0..23 keep their frequency, pairs 40..63 are divided by 4, and pair 23 + k in between blends k / 17 of each."""
    rope = rope_parameters(_config(QWEN3_131K, 131072))
    inv_freq = rope_inv_freq(128, rope)
    unscaled = 1e6 ** -(torch.arange(0, 128, 2).double() / 128)
    blend = torch.clamp((torch.arange(64).double() - 23) / 17, 0, 1)
    assert torch.allclose(inv_freq.double(), unscaled * (1 - blend) + unscaled / 4 * blend, rtol=1e-6)
    assert torch.allclose(inv_freq[:24].double(), unscaled[:24], rtol=1e-6)
    assert torch.allclose(inv_freq[40:].double(), unscaled[40:] / 4, rtol=1e-6)
    assert rope_attention_factor(rope) == pytest.approx(0.1 * math.log(4) + 1)
    assert attention_softmax_scale(rope, 128, 131072) == pytest.approx((0.1 * math.log(4) + 1) ** 2 / math.sqrt(128))
    assert attention_softmax_scale({"rope_type": "default", "rope_theta": 1e6}, 128, 40960) is None


@pytest.mark.parametrize("case", ["qwen3-131k", "gpt-oss"])
def test_cos_sin_tables_equal_transformers(case):
    """What HF's attention multiplies queries and keys by, at positions across the whole 131k context: cos and
    sin of position x frequency (fp32, as Megatron's rotary embedding forms them), times the attention factor."""
    config = _config(*YARN_CASES[case])
    positions = torch.tensor([[0, 1, 31, 4095, 4096, 32767, 32768, 65535, 100000, 131071]])
    cos, sin = Qwen3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    rope = rope_parameters(config)
    angles = torch.outer(positions[0].float(), rope_inv_freq(128, rope))
    angles = torch.cat([angles, angles], dim=-1)
    factor = rope_attention_factor(rope)
    assert torch.allclose(cos[0], angles.cos() * factor, rtol=0, atol=1e-6)
    assert torch.allclose(sin[0], angles.sin() * factor, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("model", "head_dim"), [("tiny-qwen3-yarn", 32), ("qwen3-30b-a3b-yarn131k", 128)])
def test_megatron_spec_carries_frequencies_and_softmax_scale(model, head_dim):
    """The Megatron model of a YaRN checkpoint (dense, and Qwen3-30B-A3B's MoE with the 131k settings) rotates with
    HF's frequencies and scales its attention logits by the factor squared."""
    from megarl.models.hf_config import config_from_dict
    from megarl.testing.tiny_checkpoint import tiny_config

    config = config_from_dict(tiny_config(model))
    spec = get_architecture(config.model_type).to_mcore(config)
    expected_inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert torch.equal(spec.rope_inv_freq, expected_inv_freq)
    assert spec.config_kwargs["softmax_scale"] == pytest.approx(factor**2 / math.sqrt(head_dim))


def test_yarn_with_partial_rotary_is_refused_naming_both_keys():
    """YaRN's attention factor scales only the rotated dimensions of a partially rotary head: no softmax scale gives
    those logits, so the model is refused rather than trained differently from HF's."""
    from megarl.errors import UserError
    from megarl.models.hf_config import config_from_dict
    from megarl.testing.tiny_checkpoint import tiny_config

    config = config_from_dict({**tiny_config("tiny-qwen3-yarn"), "partial_rotary_factor": 0.5})
    with pytest.raises(UserError, match=r"rope_type='yarn' with partial_rotary_factor=0.5 is not supported for qwen3"):
        get_architecture("qwen3").to_mcore(config)


def test_no_softmax_scale_without_yarn():
    from megarl.models.hf_config import config_from_dict
    from megarl.testing.tiny_checkpoint import tiny_config

    spec = get_architecture("qwen3").to_mcore(config_from_dict(tiny_config("tiny-qwen3")))
    assert "softmax_scale" not in spec.config_kwargs


def test_tiny_qwen3_yarn_logits_equal_hf(ranks4, hf_reference):
    """48 tokens, past the tiny model's 32 original positions: Megatron-Core logits at TP = 1, TP = 2 and CP = 2
    equal the HF model's. The same weights with plain RoPE give logits far from these (the check has teeth)."""
    from helpers import hf_logits
    from transformers import AutoModelForCausalLM

    from megarl.models.hf_config import load_hf_config

    folder, ids, expected = hf_reference("tiny-qwen3-yarn")
    for layout in (ParallelConfig(), ParallelConfig(tp=2)):
        logits = one_result(ranks4.run(megatron_logits, str(folder), layout, ids))
        print(f"tp{layout.tp}: largest logit difference {(logits - expected).abs().max().item():.1e}")
        assert (logits - expected).abs().max().item() < 1e-4, layout
    cp2 = [r for r in ranks4.run(megatron_logits, str(folder), ParallelConfig(cp=2), ids) if r is not None]
    print(f"cp2: largest logit difference {max((r - expected).abs().max().item() for r in cp2):.1e}")
    assert len(cp2) == 2 and all((r - expected).abs().max().item() < 1e-4 for r in cp2)

    odd = sample_ids(1000, batch=2, seq=37)  # padded to 40 for the CP split
    cp2 = [r for r in ranks4.run(megatron_logits, str(folder), ParallelConfig(cp=2), odd) if r is not None]
    assert (cp2[0] - hf_logits(folder, odd)).abs().max().item() < 1e-4

    plain = load_hf_config(folder)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    model = AutoModelForCausalLM.from_pretrained(folder, config=plain, dtype=torch.float32)
    with torch.no_grad():
        plain_difference = (model(ids).logits - expected).abs().max().item()
    print(f"plain RoPE on the same weights: largest logit difference {plain_difference:.2f}")
    assert plain_difference > 0.05
