"""Uneven pipeline stages: megarl's one layer-id function equals Megatron-Core's own rule, and bad layouts are refused
before any process starts, naming the key and what would be valid."""

from __future__ import annotations

import itertools

import pytest
import torch

from megarl.errors import UserError
from megarl.runtime.parallel import ParallelConfig
from megarl.runtime.stages import StageLayout


def _megatron_layers(num_layers: int, layout: StageLayout) -> dict[tuple[int, int], list[int]]:
    """(stage, chunk) -> layer ids, from Megatron's get_transformer_layer_offset and get_num_layers_to_build."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=layout.first,
        num_layers_in_last_pipeline_stage=layout.last,
        pipeline_dtype=torch.float32,
    )
    found = {}
    for stage, chunk in itertools.product(range(layout.pp), range(layout.vpp)):
        vp = chunk if layout.vpp > 1 else None
        offset = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=stage)
        count = get_num_layers_to_build(config, vp_stage=vp, pp_rank=stage)
        found[stage, chunk] = list(range(offset, offset + count))
    return found


def _layouts():
    for num_layers in (4, 7, 8, 12, 61):
        for pp, vpp in ((2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2), (16, 1)):
            edges = [None, *range(1, num_layers)]
            for first, last in itertools.product(edges, edges):
                layout = StageLayout(pp, vpp, first, last)
                try:
                    layout.check(num_layers)
                except UserError:
                    continue
                yield num_layers, layout


VALID = list(_layouts())


def _id(num_layers: int, layout: StageLayout) -> str:
    return f"L{num_layers}-pp{layout.pp}-vpp{layout.vpp}-first{layout.first}-last{layout.last}"


def test_the_sweep_covers_uneven_and_interleaved_layouts():
    assert len(VALID) > 100
    assert any(layout.uneven and layout.vpp > 1 and layout.pp > 2 for _, layout in VALID)
    assert (61, StageLayout(16, 1, 1, None)) in VALID and (61, StageLayout(16, 1, 3, 2)) in VALID


def test_layer_ids_equal_megatrons():
    for num_layers, layout in VALID:
        ours = {
            (stage, chunk): layout.chunk_layers(num_layers, stage, chunk)
            for stage, chunk in itertools.product(range(layout.pp), range(layout.vpp))
        }
        assert ours == _megatron_layers(num_layers, layout), _id(num_layers, layout)
        assert sorted(itertools.chain(*ours.values())) == list(range(num_layers)), _id(num_layers, layout)


def test_deepseek_v3_layout_of_the_published_recipe():
    """61 layers at pp=16: 1 on the first stage, 4 on each of the 15 others."""
    layout = StageLayout(16, 1, first=1)
    assert layout.stage_sizes(61) == [1] + [4] * 15
    assert layout.stage_layers(61, 0) == [0] and layout.stage_layers(61, 15) == [57, 58, 59, 60]


@pytest.mark.parametrize(
    "layout,message",
    [
        (StageLayout(4, 1), r"pp=4 x vpp=1 does not divide num_hidden_layers=61 .* give the first/last stage fewer"),
        (StageLayout(16, 1, 2, 2), r"first_stage_layers=2 and .*last_stage_layers=2 leave 57 .* 14 middle stage"),
        (StageLayout(4, 2, 3, None), r"pp_first_stage_layers=3 must be a positive multiple of vpp=2"),
        (StageLayout(16, 1, 61, None), r"leave 0 of num_hidden_layers=61 for 15 middle stage"),
    ],
)
def test_impossible_stages_are_refused_naming_the_key(layout, message):
    with pytest.raises(UserError, match=message):
        layout.check(61)


def test_the_refusal_suggests_a_layout_that_works():
    with pytest.raises(UserError, match=r"e\.g\. first=3, last=4 with 9 per middle stage$"):
        StageLayout(8, 1, 2, 2).check(61)
    StageLayout(8, 1, 3, 4).check(61)  # 3 + 6 x 9 + 4 = 61


def test_parallel_config_names_the_keys_and_flags():
    with pytest.raises(UserError, match=r"^actor.parallel.pp_first_stage_layers/actor.parallel.pp_last_stage_layers"):
        ParallelConfig(pp_first_stage_layers=1).check("actor.parallel")
    with pytest.raises(UserError, match=r"^--pp-first-stage-layers/--pp-last-stage-layers need .*\(--pp > 1\)"):
        ParallelConfig(pp_last_stage_layers=1).check("--")
    parallel = ParallelConfig(pp=16, pp_first_stage_layers=1)
    assert parallel.layout_dict() == {"tp": 1, "pp": 16, "vpp": 1, "pp_first_stage_layers": 1}
    assert parallel.megatron_stage_kwargs() == {
        "num_layers_in_first_pipeline_stage": 1,
        "num_layers_in_last_pipeline_stage": None,
    }
