"""Delta weight sync into SGLang (megarl/rollout/sglang_delta.py): applied through SGLang's own model classes and
loaders on CPU (tests/sglang_delta_check.py, one subprocess for the module), the per-tensor hash checked by hand and
its replication rule on simulated two-rank splits, and rollout.weight_sync_delta's resolution per backend, road and
model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sglang_contract
import torch

from megarl.errors import UserError
from megarl.rollout.config import DELTA_LOADER, RolloutConfig
from megarl.rollout.sglang_delta import check_sums, partial_sums
from megarl.testing.tiny_checkpoint import make_hf_checkpoint, tiny_config
from megarl.workers.weight_delta import DeltaBucket, DeltaEntry, tensor_hash

TESTS = Path(__file__).parent
ARCHITECTURES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"]  # tiny-qwen2: tied, biases


# ---- SGLang's own model classes --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sglang_results(tmp_path_factory) -> dict[str, dict]:
    """Every model's check, and the launch command's parse, from one run of tests/sglang_delta_check.py."""
    if not sglang_contract.installed():
        pytest.skip(sglang_contract.INSTALL_HINT)
    folder = tmp_path_factory.mktemp("sglang-delta")
    dirs = []
    for name in ARCHITECTURES:
        config = tiny_config(name)
        if name == "tiny-qwen3-moe":  # SGLang's Qwen3-MoE has no dense layers (mlp_only_layers)
            config = config | {"mlp_only_layers": []}
        dirs.append(str(make_hf_checkpoint(config, folder / name)))
    # two tensor-parallel ranks: tiny-llama's 2 KV heads one per rank; with 1 KV head, k/v replicated on both
    kv1 = make_hf_checkpoint(tiny_config("tiny-llama") | {"num_key_value_heads": 1}, folder / "tiny-llama-kv1")
    mla = make_hf_checkpoint("tiny-deepseek-v3", folder / "tiny-deepseek-v3")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    models = [*dirs, "--tp2", dirs[0], "--tp2", str(kv1), str(mla)]
    done = subprocess.run(
        [sys.executable, str(TESTS / "sglang_delta_check.py"), "--parse", *models],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            assert result["rc"] == 0, f"{result['model']} failed:\n{done.stderr[-3000:]}"
            name = Path(result["model"]).name
            results[name if result["tp"] == 1 else f"{name} tp2 rank{result['rank']}"] = result
    assert len(results) == len(ARCHITECTURES) + 6, done.stderr[-3000:]
    return results


def test_sglang_parses_megarl_s_delta_loader_from_the_launch_command(sglang_results):
    assert sglang_results["--parse"]["custom_weight_loader"] == [DELTA_LOADER]


TP2 = [f"{name} tp2 rank{rank}" for name in ("tiny-llama", "tiny-llama-kv1") for rank in (0, 1)]


@pytest.mark.parametrize("name", ARCHITECTURES + TP2)
def test_delta_applied_through_sglang_s_loaders_equals_the_full_load(sglang_results, name):
    result = sglang_results[name]
    # deltas and whole tensors within the delta buckets; every parameter bit for bit as after loading W1 whole
    assert result["counts"]["delta"] > 0 and result["counts"]["whole"] > 0, result["counts"]
    assert result["verdicts"] == []
    assert result["mismatched"] == []
    assert result["loaders_restored"] is True


def test_two_ranks_each_hold_a_shard(sglang_results):
    whole = sglang_results["tiny-llama"]["elements"]
    assert sglang_results["tiny-llama tp2 rank0"]["elements"] < whole  # norms replicated, the rest split
    assert sglang_results["tiny-llama tp2 rank0"]["elements"] == sglang_results["tiny-llama tp2 rank1"]["elements"]


@pytest.mark.parametrize("name", ARCHITECTURES + TP2)
def test_delta_against_a_wrong_base_is_refused_naming_the_tensor(sglang_results, name):
    # the wrong element is in k_proj: on one rank only at tp 2 with 2 KV heads; both ranks refuse (the sums are
    # collective). With 1 KV head k_proj is on both ranks: held twice, which the hash rule expects
    result = sglang_results[name]
    target, numel = result["wrong_target"], result["wrong_numel"]
    held = 2 * numel if "kv1" in name else numel
    assert target.endswith("layers.0.self_attn.k_proj.weight")
    assert result["wrong_verdicts"] == [
        f"megarl delta weight sync: {target}: the engine's elements after the delta do not hash to the sender's "
        f"({held} elements held for {numel}); the engine did not hold the weights the delta was made against"
    ]
    assert result["after_refusal"] is None  # reported once: the next update goes through
    assert result["unknown_name"] == (
        "megarl delta weight sync: model.layers.0.mlp.unknown.weight changed no parameter of the engine (a name its "
        "loaders skip)"
    )


def test_an_mla_model_refuses_every_delta_bucket(sglang_results):
    # DeepSeek-V3's loaders turn kv_b_proj into w_kc / w_vc after loading: a delta written into kv_b_proj would not
    # reach them, so the loader refuses the model (rollout.weight_sync_delta=auto keeps delta off for MLA models)
    result = sglang_results["tiny-deepseek-v3"]
    refused = (
        "megarl delta weight sync: not applicable to this model: its load_weights post-processes what it loads "
        "(MLA's kv_b_proj -> w_kc/w_vc)"
    )
    assert result["counts"]["delta"] > 0 and set(result["verdicts"]) == {refused}


# ---- the map's own checks, on a stand-in model whose loaders do what a model's might --------------------------------
class LoaderModel(torch.nn.Module):
    """One parameter `w`, loaded by `load(param, tensor)` as SGLang's load_weights does (params_dict, weight_loader);
    names it does not know are skipped."""

    def __init__(self, shape, load) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        self.w.weight_loader = load

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name in params:
                params[name].weight_loader(params[name], tensor)


def _apply_to(model, old: torch.Tensor, new: torch.Tensor) -> str | None:
    """A delta from old to new (HF name "w") through the loader; the verdict SGLang would answer with."""
    from megarl.rollout.sglang_delta import load_delta_bucket
    from megarl.rollout.sglang_weights import FlatBucket, flatten_bucket, named_payload
    from megarl.workers.weight_delta import DeltaEncoder, delta_to_bucket

    encoder = DeltaEncoder()
    encoder.encode([("w", old)])
    part = flatten_bucket(delta_to_bucket(encoder.encode([("w", new)])))
    load_delta_bucket(model, named_payload(FlatBucket(part.flat, part.entries, DELTA_LOADER)), reduce=lambda s: s)
    verdict = getattr(model, "_megarl_delta_verdict", None)
    return verdict._derived_weight_cache_error if verdict is not None else None


def test_the_map_follows_a_loader_that_permutes_and_refuses_one_that_computes():
    old = torch.randn(4, 6)
    new = old.clone()
    new[1, 2], new[3, 5] = 7.0, -1.5
    transposing = LoaderModel((6, 4), lambda param, t: param.data.copy_(t.t()))
    transposing.w.data.copy_(old.t())
    assert _apply_to(transposing, old, new) is None
    assert torch.equal(transposing.w.data, new.t())
    scaling = LoaderModel((4, 6), lambda param, t: param.data.copy_(t * 2))
    scaling.w.data.copy_(old * 2)
    assert _apply_to(scaling, old, new) == (
        "megarl delta weight sync: a loader of this model does more than copy what it loads (its parameters hold "
        "values that are no element of the checkpoint's tensors): set rollout.weight_sync_delta=off"
    )
    assert scaling.w.weight_loader.__name__ == "<lambda>"  # the recording wrapper is gone again


# ---- the hash --------------------------------------------------------------------------------------------------------
def _mix_by_hand(index: int, bits: int) -> int:
    """splitmix64's finalizer over index * golden ratio + bits, in Python integers mod 2^64."""
    mask = 2**64 - 1
    x = (index * 0x9E3779B97F4A7C15 + bits) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def _signed(value: int) -> int:
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


def test_tensor_hash_by_hand():
    # float32 1.0 = 0x3F800000, -2.0 = 0xC0000000 (as int32: -2^30, sign-extended); bf16 -2.0 = 0xC000 (-2^14)
    f32 = torch.tensor([1.0, -2.0])
    assert tensor_hash(f32) == _signed(_mix_by_hand(0, 0x3F800000) + _mix_by_hand(1, -(2**30)))
    bf16 = torch.tensor([[-2.0]], dtype=torch.bfloat16)
    assert tensor_hash(bf16) == _signed(_mix_by_hand(0, -(2**14)))
    assert tensor_hash(torch.tensor([0.0])) != tensor_hash(torch.tensor([-0.0]))  # bits, not values


def test_the_wire_format_carries_each_delta_s_hash_and_shape_and_never_costs_more_than_whole_tensors():
    from megarl.workers.weight_delta import DeltaEncoder, bucket_to_delta, delta_to_bucket

    g = torch.Generator().manual_seed(0)
    old = [("a", torch.randn(64, 32, generator=g).to(torch.bfloat16)), ("b", torch.randn(7, generator=g))]
    encoder = DeltaEncoder()
    encoder.encode(old)
    for share in (0.01, 0.3, 0.5, 1.0):  # few changes: deltas; many: whole tensors
        new = []
        for name, tensor in old:
            moved = tensor.clone()
            where = torch.randperm(moved.numel(), generator=g)[: int(moved.numel() * share)]
            moved.view(-1)[where] += 1
            new.append((name, moved))
        bucket = delta_to_bucket(encoder.encode(new))
        assert sum(t.nbytes for _, t in bucket) <= sum(t.nbytes for _, t in new) + 8  # + the bucket's CRC
        received = bucket_to_delta(bucket)
        for entry in received.entries if received is not None else []:
            if entry.full is None:
                assert entry.hash == tensor_hash(dict(new)[entry.name]) and entry.shape == dict(new)[entry.name].shape
        old = new


# ---- the replication rule over a simulated two-rank split ------------------------------------------------------------
def _entry(tensor: torch.Tensor) -> DeltaBucket:
    entry = DeltaEntry("w", tuple(tensor.shape), tensor.dtype, torch.zeros(0), torch.zeros(0), hash=tensor_hash(tensor))
    return DeltaBucket([entry], 0, 0)


def _rank_sums(tensor: torch.Tensor, rows: list[int], spoil: bool = False) -> torch.Tensor:
    """What one rank holding `rows` of `tensor` adds (partial_sums: hash partial, then count)."""
    local = torch.arange(tensor.numel()).view(tensor.shape)[rows].reshape(-1)
    held = tensor.reshape(-1)[local].clone()
    if spoil:
        held[0] += 1
    sums = torch.zeros(2, dtype=torch.int64)
    partial_sums(torch.zeros_like(local), local, held.to(torch.float32), [tensor.dtype], sums)
    return sums


@pytest.mark.parametrize(
    "rank_rows, ok",
    [
        ([[0, 1], [2, 3]], True),  # sharded (m = 1)
        ([[0, 1, 2, 3], [0, 1, 2, 3]], True),  # replicated (m = tp = 2)
        ([[0, 1, 2, 3], []], True),  # all on one rank (an expert under EP)
        ([[0, 1, 2], [2, 3]], False),  # row 2 twice, the rest once
        ([[0, 1], [0, 1]], False),  # numel elements in all, but rows 2-3 held by none
    ],
)
def test_partial_sums_add_up_over_the_ranks_only_for_uniform_replication(rank_rows, ok):
    tensor = torch.randn(4, 6).to(torch.bfloat16)
    total = sum(_rank_sums(tensor, rows) for rows in rank_rows)
    verdict = check_sums(_entry(tensor), total.tolist())
    assert (verdict is None) == ok, verdict
    if not ok:
        assert verdict.startswith("megarl delta weight sync: w: the engine's elements after the delta do not hash")


def test_a_spoiled_element_on_one_rank_and_a_tensor_no_rank_holds_are_refused():
    tensor = torch.randn(4, 6).to(torch.bfloat16)
    total = _rank_sums(tensor, [0, 1]) + _rank_sums(tensor, [2, 3], spoil=True)
    assert check_sums(_entry(tensor), total.tolist()).endswith(
        "(24 elements held for 24); the engine did not hold the weights the delta was made against"
    )
    assert check_sums(_entry(tensor), [0, 0]) == (
        "megarl delta weight sync: w changed no parameter of the engine (a name its loaders skip)"
    )


# ---- rollout.weight_sync_delta ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "backend, transport, quantization, mla, expected",
    [
        ("hf", "object_store", None, None, True),
        ("hf", "ipc", None, None, True),
        ("hf", "in_process", None, None, False),  # the hybrid engine copies whole tensors
        ("sglang", "ipc", None, False, False),  # auto: only a CUDA IPC handle travels, nothing to save (`on`: deltas)
        ("sglang", "object_store", None, False, True),  # update_weights_from_tensor into the delta loader
        ("sglang", "nccl", None, False, False),  # update_weights_from_distributed calls no custom loader
        ("sglang", "disk", None, False, False),
        ("sglang", "ipc_relay", None, False, False),
        ("sglang", "object_store", {"quant_method": "fp8"}, False, False),  # the loaders quantize
        ("sglang", "object_store", None, True, False),  # MLA: kv_b_proj -> w_kc / w_vc
        ("sglang", "object_store", None, None, False),  # the family not known
    ],
)
def test_auto_resolution(backend, transport, quantization, mla, expected):
    assert RolloutConfig(backend=backend).sync_delta(transport, quantization, mla) is expected
    assert RolloutConfig(backend=backend, weight_sync_delta="off").sync_delta(transport, quantization, mla) is False


def test_on_is_refused_where_the_engines_cannot_take_deltas():
    on = RolloutConfig(backend="sglang", gpus_per_engine=1, weight_sync_delta="on")
    on.check("rollout")  # the colocated road (weight_sync auto) can take them
    assert on.sync_delta("ipc", None, False) and on.sync_delta("ipc")  # the family not known: as set
    with pytest.raises(UserError, match=r"^rollout.weight_sync_delta=on: an MLA model \(DeepSeek-V3 family\)"):
        on.sync_delta("ipc", None, True)
    with pytest.raises(UserError, match=r"^rollout.weight_sync_delta=on: weight_sync=nccl: SGLang calls megarl's"):
        on.sync_delta("nccl", None, False)
    with pytest.raises(UserError, match=r"^rollout.weight_sync_delta=on: FP8 rollout weights"):
        on.sync_delta("ipc", {"quant_method": "fp8"}, False)
    for road in ("nccl", "disk"):
        with pytest.raises(UserError, match=rf"^rollout.weight_sync_delta=on with rollout.weight_sync={road}: "):
            RolloutConfig(backend="sglang", weight_sync=road, weight_sync_delta="on").check("rollout")
    with pytest.raises(UserError, match=r"^rollout.weight_sync_delta=on with rollout.weights_format=fp8: "):
        RolloutConfig(backend="sglang", weights_format="fp8", weight_sync_delta="on").check("rollout")


def test_the_model_family_from_its_folder(tmp_path):
    from megarl.rollout.sglang_launch import model_is_mla

    for model_type, mla in (("llama", False), ("qwen3_moe", False), ("deepseek_v3", True), ("kimi_k2", True)):
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert model_is_mla(folder) is mla
        assert RolloutConfig(backend="sglang").sync_delta("object_store", None, model_is_mla(folder)) is not mla
    assert model_is_mla(tmp_path / "absent") is None  # not readable here: auto stays off for SGLang
