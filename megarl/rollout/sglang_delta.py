"""Delta weight sync into SGLang (rollout.weight_sync_delta), through stock SGLang's `--custom-weight-loader` hook.

A server started with `--custom-weight-loader megarl.rollout.sglang_delta.load_delta_bucket` (sglang_server.py
always adds it) accepts `update_weights_from_tensor(load_format=DELTA_LOADER)`: each tensor-parallel rank then calls
`load_delta_bucket(model, named_tensors)` with its own payload. Only that road (colocated: CUDA IPC / tensor
payloads) calls custom loaders; SGLang's broadcast (`update_weights_from_distributed`) and disk roads do not.

**The payload** (`delta_payload`): one flattened delta bucket (megarl/workers/weight_delta.py `delta_to_bucket`) as
ONE named tensor, its flat bytes, named `megarl.delta:` + the JSON of its records (name, shape, dtype, byte range):
one CUDA IPC handle per rank and request, however many tensors the bucket holds.

**Applying without the full tensor.** A rank holds only its shard of each HF tensor, inside SGLang's own (possibly
fused: qkv_proj, gate_up_proj, w13 experts) parameters. Where the delta's HF flat indices land is found by SGLang's
own loaders, with no per-model code (`apply_bucket`): every parameter's `weight_loader` is replaced by a recording
wrapper, and `model.load_weights` is called with float64 tensors of the HF shapes holding their flat indices
(offset per tensor, so one call maps a whole bucket; exact integers up to 2^53), one tensor at a time; the wrapper
hands the original loader an integer scratch of the parameter's shape (int32: a bucket has fewer than 2^31
elements; the parameter's attributes copied: output_dim, packed_dim, ... which loaders read) filled with -1. Global
indices start at 1: afterwards a scratch position > 0 is held by this rank and its value is the index, 0 is padding
the loader zeroed (the vocabulary rows past the checkpoint's), -1 untouched. A value that is no index (a loader
that scales or sums) marks the bucket as not applicable; one that is the wrong index writes the wrong element,
which the hash below refuses. The sent values are then written at the held positions whose index is in the
delta. Whole tensors of the bucket load through `model.load_weights` as usual. Peak extra memory: 4 bytes per
element of the parameters the bucket's delta tensors touch (their scratch: for experts, the layer's w13/w2 on
this rank) plus 8 per element of one HF tensor. One call per bucket rather than per tensor: an expert tensor
touches its layer's whole w13, which a map per tensor would fill again for each of the layer's experts.

**Verification** (`check_sums`): per HF tensor the sender sends `tensor_hash` (sum over elements of
element_mix(index, bits), wrapping int64) and its shape. Each rank sums element_mix over the elements it holds
(indices from the map, bits from its parameters after the delta, in the sent dtype) and counts them; the sums are
added over SGLang's TP group. Where every element is held by the same number m of ranks (m = 1 sharded, m = tp
replicated, m = r for KV heads replicated r times) the totals are m * hash and m * numel: anything else (a wrong
base, a misplaced write, a rank that holds nothing of a tensor) names the tensor.

**Reporting.** SGLang ignores what a custom loader returns, and an exception inside it ends the scheduler (the
server dies). So the loader never raises: every rank reaches the same verdict (the sums are collective) and arms a
one-shot `_derived_weight_cache_error` on a child module of the model, which SGLang reads at the start of the next
weight update (`_unsupported_derived_weight_cache_error`: answered success False with the message, nothing
loaded). The sender (sglang_weights.send_flattened_bucket) asks right after each delta bucket with an empty payload
and turns the refusal into DeltaMismatch: the sync fails, the engines are quarantined and the next sync is full.

Not for models whose load_weights post-processes what it loaded (MLA's kv_b_proj -> w_kc / w_vc) or FP8 weights
(the loader quantizes): `refusal` names them, and RolloutConfig.sync_delta keeps delta off there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import torch

from megarl.rollout.config import DELTA_LOADER
from megarl.workers.weight_delta import (
    DeltaBucket,
    DeltaMismatch,
    bucket_to_delta,
    element_bits,
    element_mix,
    wrap64,
)

PAYLOAD_PREFIX = "megarl.delta:"
VERDICT_PREFIX = "megarl delta weight sync: "
"""How the engine's refusal begins (the sender recognizes it)."""
_CHUNK = {"cpu": 2**16, "cuda": 2**22}
"""Scratch elements examined at once after the map: on the host what stays in cache, on a GPU few kernel launches
(int64 temporaries of 32 MiB)."""

Records = list[tuple[str, tuple[int, ...], torch.dtype, int, int]]


# ---- the payload -----------------------------------------------------------------------------------------------------
def payload_name(records: Records) -> str:
    """The one named tensor's name: the prefix and the records (name, shape, dtype, start, end) as JSON."""
    rows = [
        [name, list(shape), str(dtype).removeprefix("torch."), start, end] for name, shape, dtype, start, end in records
    ]
    return PAYLOAD_PREFIX + json.dumps(rows, separators=(",", ":"))


def unpack(named_tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The bucket a payload carries (views into its flat bytes)."""
    bucket = []
    for name, flat in named_tensors:
        if not name.startswith(PAYLOAD_PREFIX):
            raise DeltaMismatch(f"{VERDICT_PREFIX}an update for {DELTA_LOADER} holds {name!r}, not a delta payload")
        for tensor_name, shape, dtype, start, end in json.loads(name.removeprefix(PAYLOAD_PREFIX)):
            bucket.append((tensor_name, flat[start:end].view(getattr(torch, dtype)).view(shape)))
    return bucket


# ---- the index map ---------------------------------------------------------------------------------------------------
def refusal(model: torch.nn.Module) -> str | None:
    """Why deltas cannot be applied to this model through its loaders (None: they can)."""
    if hasattr(model, "post_load_weights") or any(hasattr(m, "w_kc") for m in model.modules()):
        return "its load_weights post-processes what it loads (MLA's kv_b_proj -> w_kc/w_vc)"
    fp8 = [n for n, p in model.named_parameters() if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if fp8:
        return f"it holds FP8 parameters ({fp8[0]}, ...), which its loaders quantize into"
    return None


def _default_loader() -> Callable:
    """What SGLang's load_weights use for a parameter without a weight_loader attribute."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    return default_weight_loader


class _Recorder:
    """Every parameter's weight_loader replaced by a wrapper that loads into an integer scratch instead."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.scratch: dict[int, tuple[str, torch.nn.Parameter, torch.Tensor]] = {}
        self.saved: list[tuple[torch.nn.Parameter, object]] = []

    def __enter__(self) -> _Recorder:
        seen: set[int] = set()
        for name, param in self.params.items():
            if id(param) in seen:
                continue  # tied: one wrapper
            seen.add(id(param))
            original = param.__dict__.get("weight_loader")
            self.saved.append((param, original))
            param.weight_loader = self._wrap(name, param, original or _default_loader())
        return self

    def __exit__(self, *exc) -> None:
        for param, original in self.saved:
            if original is None:
                del param.weight_loader
            else:
                param.weight_loader = original

    def _wrap(self, name: str, param: torch.nn.Parameter, loader: Callable) -> Callable:
        def record(target, loaded_weight, *args, **kwargs):
            if target is not param:  # a loader handed another tensor: not the copy this map understands
                raise DeltaMismatch(f"{VERDICT_PREFIX}{name}'s loader was called for another tensor")
            found = self.scratch.get(id(param))
            if found is None:
                scratch = torch.nn.Parameter(
                    torch.full(param.shape, -1, dtype=self.dtype, device=param.device), requires_grad=False
                )
                for key, value in param.__dict__.items():
                    if key != "weight_loader":
                        setattr(scratch, key, value)
                found = self.scratch[id(param)] = (name, scratch, param)
            return loader(found[1], loaded_weight, *args, **kwargs)

        return record


def _index_tensors(delta: DeltaBucket, bases: list[int], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Each delta tensor, HF-shaped, holding its global index (its base + flat index) as float64, made on the
    model's device (no host copy): one at a time."""
    for entry, base in zip(delta.entries, bases):
        numel = int(torch.Size(entry.shape).numel())
        yield entry.name, torch.arange(base, base + numel, dtype=torch.float64, device=device).view(entry.shape)


# ---- applying and the partial sums -----------------------------------------------------------------------------------
def partial_sums(
    entry_of: torch.Tensor, local: torch.Tensor, held: torch.Tensor, dtypes: list[torch.dtype], sums: torch.Tensor
) -> None:
    """Add to `sums` (int64 [2 K]: K hash partials, then K counts) the elements this rank holds: `entry_of[j]` the
    delta tensor, `local[j]` its flat index, `held[j]` the value held now (any dtype the sent one converts from)."""
    num = len(dtypes)
    for dtype in set(dtypes):
        if len(set(dtypes)) == 1:  # the common case: no selection
            pick_entry, pick_local, pick_held = entry_of, local, held
        else:
            pick = torch.tensor([d == dtype for d in dtypes], device=entry_of.device)[entry_of]
            pick_entry, pick_local, pick_held = entry_of[pick], local[pick], held[pick]
        mixed = element_mix(pick_local, element_bits(pick_held.to(dtype)))
        sums[:num].index_add_(0, pick_entry.to(sums.device), mixed.to(sums.device))
    sums[num:] += torch.bincount(entry_of, minlength=num).to(sums.device)


def check_sums(delta: DeltaBucket, sums: list[int]) -> str | None:
    """The verdict over the whole TP group's summed partials (check_sums' rule in the module docstring)."""
    num = len(delta.entries)
    for k, entry in enumerate(delta.entries):
        numel = int(torch.Size(entry.shape).numel())
        got, count = sums[k], sums[num + k]
        if count == 0:
            return f"{VERDICT_PREFIX}{entry.name} changed no parameter of the engine (a name its loaders skip)"
        copies = count // numel
        if count % numel or got != wrap64(copies * entry.hash):
            return (
                f"{VERDICT_PREFIX}{entry.name}: the engine's elements after the delta do not hash to the sender's "
                f"({count} elements held for {numel}); the engine did not hold the weights the delta was made against"
            )
    return None


def apply_bucket(model: torch.nn.Module, delta: DeltaBucket) -> torch.Tensor:
    """Apply a delta bucket to this rank's parameters; returns its partial sums (int64 [2 K + 1], the last: 1 where
    the map found a loader that did not copy)."""
    num = len(delta.entries)
    sums = torch.zeros(2 * num + 1, dtype=torch.int64)
    whole = [(e.name, e.full) for e in delta.entries if e.full is not None]
    if whole:
        model.load_weights(whole)
    deltas = DeltaBucket([e for e in delta.entries if e.full is None], delta.checksum, 0)
    if not deltas.entries:
        return sums
    bases, total = [], 1  # 0: what a loader's zero fill (padding) leaves
    for entry in deltas.entries:
        bases.append(total)
        total += int(torch.Size(entry.shape).numel())
    with _Recorder(model, torch.int32 if total < 2**31 else torch.int64) as recorder:
        device = next(iter(recorder.params.values())).device
        model.load_weights(_index_tensors(deltas, bases, device))
    base_t = torch.tensor(bases, dtype=torch.int64, device=device)
    changed = torch.cat([b + e.indices.to(device=device, dtype=torch.int64) for b, e in zip(base_t, deltas.entries)])
    one_dtype = len({e.values.dtype for e in deltas.entries}) == 1  # else float64: every float converts exactly
    values = torch.cat([e.values.to(device, None if one_dtype else torch.float64) for e in deltas.entries])
    changed, order = changed.sort()
    values = values[order]
    dtypes = [e.dtype for e in deltas.entries]
    part = torch.zeros(2 * len(deltas.entries), dtype=torch.int64)
    for _name, scratch, param in recorder.scratch.values():
        flat, marks = param.data.view(-1), scratch.data.view(-1)
        size = _CHUNK.get(marks.device.type, _CHUNK["cuda"])
        for start in range(0, marks.numel(), size):
            chunk = marks[start : start + size]
            where = torch.nonzero(chunk > 0).reshape(-1)
            if where.numel() == 0:
                continue
            index = chunk[where]
            if bool((index >= total).any()) or bool(((chunk < 0) & (chunk != -1)).any()):  # no element index
                sums[-1] = 1
                return sums
            index, where = index.to(torch.int64), where + start
            if changed.numel():
                slot = torch.searchsorted(changed, index).clamp(max=changed.numel() - 1)
                hit = changed[slot] == index
                flat[where[hit]] = values[slot[hit]].to(flat.dtype)
            entry_of = torch.searchsorted(base_t, index, right=True) - 1
            partial_sums(entry_of, index - base_t[entry_of], flat[where], dtypes, part)
    full_index = [k for k, e in enumerate(delta.entries) if e.full is None]
    sums[torch.tensor(full_index, dtype=torch.int64)] = part[: len(full_index)]
    sums[torch.tensor([num + k for k in full_index], dtype=torch.int64)] = part[len(full_index) :]
    return sums


def verdict_of(delta: DeltaBucket, sums: torch.Tensor) -> str | None:
    """The bucket's verdict from the summed partials (whole tensors are overwritten: nothing to check)."""
    if int(sums[-1]):
        return (
            f"{VERDICT_PREFIX}a loader of this model does more than copy what it loads (its parameters hold values "
            "that are no element of the checkpoint's tensors): set rollout.weight_sync_delta=off"
        )
    checked = [k for k, e in enumerate(delta.entries) if e.full is None]
    num = len(delta.entries)
    rows = [int(v) for v in sums.tolist()]
    sub = DeltaBucket([delta.entries[k] for k in checked], delta.checksum, 0)
    return check_sums(sub, [rows[k] for k in checked] + [rows[num + k] for k in checked])


# ---- SGLang's hook ---------------------------------------------------------------------------------------------------
class _Verdict(torch.nn.Module):
    """A child of the model whose `_derived_weight_cache_error` SGLang reads before every weight update: the
    message once (that update is refused with it), then None."""

    def __init__(self) -> None:
        super().__init__()
        self.message: str | None = None

    @property
    def _derived_weight_cache_error(self) -> str | None:
        message, self.message = self.message, None
        return message


def _report(model: torch.nn.Module, message: str) -> None:
    verdict = getattr(model, "_megarl_delta_verdict", None)
    if verdict is None:
        verdict = _Verdict()
        model.add_module("_megarl_delta_verdict", verdict)
    verdict.message = message


def _all_reduce(sums: torch.Tensor) -> torch.Tensor:
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size > 1:
        torch.distributed.all_reduce(sums, group=group.cpu_group)
    return sums


def load_delta_bucket(
    model: torch.nn.Module,
    named_tensors: list[tuple[str, torch.Tensor]],
    reduce: Callable[[torch.Tensor], torch.Tensor] = _all_reduce,
) -> None:
    """SGLang's custom weight loader for delta buckets (module docstring), on every TP rank; never raises: a
    refusal is armed for the next request (an empty payload is such a request: nothing to apply)."""
    if not named_tensors:
        return
    delta = None
    try:
        bucket = unpack(named_tensors)
        delta = bucket_to_delta(bucket)
        if delta is None:  # a plain bucket: whole tensors
            model.load_weights(bucket)
            return
        reason = refusal(model)
        if reason is not None:
            return _report(model, f"{VERDICT_PREFIX}not applicable to this model: {reason}")  # every rank alike
        with torch.no_grad():
            sums = apply_bucket(model, delta)
    except Exception as err:  # every rank still joins the sums below: a rank that raised reports, none hangs
        message = f"{VERDICT_PREFIX}{type(err).__name__}: {err}"
        if delta is None:  # the payload itself (the same on every rank): no rank reaches the sums
            return _report(model, message)
        sums = torch.zeros(2 * len(delta.entries) + 1, dtype=torch.int64)
        sums[-1] = 2**40  # marks the failure in the sum
        _report(model, message)
    sums = reduce(sums)
    if int(sums[-1]) >= 2**40:
        verdict = getattr(model, "_megarl_delta_verdict", None)
        if verdict is None or verdict.message is None:
            _report(model, f"{VERDICT_PREFIX}another tensor-parallel rank failed to apply the bucket")
        return
    message = verdict_of(delta, sums)
    if message is not None:
        _report(model, message)
