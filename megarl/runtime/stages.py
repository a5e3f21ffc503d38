"""Which decoder layers each pipeline stage (and each of its virtual chunks) holds: the one function every part that
maps layer ids uses (model checks, planner, refit estimate), so that none can drift from Megatron-Core.

Megatron's rule (`get_transformer_layer_offset`, `get_num_layers_to_build`): without `first`/`last` the layers split
evenly over pp x vpp chunks, chunk c of stage s holding block c * pp + s. With uneven stages the first and/or last
stage hold the given number of layers and the other ("middle") stages share the rest evenly; with interleaving each
stage's layers split evenly over its vpp chunks, and virtual round c runs first-stage chunk c, then every middle
stage's chunk c, then the last stage's chunk c. tests/test_stages.py checks this against Megatron's own functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import UserError


@dataclass(frozen=True)
class StageLayout:
    """A pipeline of `pp` stages with `vpp` virtual chunks each; `first`/`last`: layers of the first/last stage when
    they differ from the even split (None: even)."""

    pp: int = 1
    vpp: int = 1
    first: int | None = None
    last: int | None = None

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None

    def stage_sizes(self, num_layers: int) -> list[int]:
        """Layers per stage (all its chunks); assumes `check(num_layers)` passed."""
        if not self.uneven:
            return [num_layers // self.pp] * self.pp
        middle_stages = self.pp - (self.first is not None) - (self.last is not None)
        middle = num_layers - (self.first or 0) - (self.last or 0)
        sizes = [middle // middle_stages if middle_stages else 0] * self.pp
        if self.first is not None:
            sizes[0] = self.first
        if self.last is not None:
            sizes[-1] = self.last
        return sizes

    def chunk_layers(self, num_layers: int, stage: int, chunk: int) -> list[int]:
        """Global (0-based) layer ids of virtual chunk `chunk` of pipeline stage `stage`."""
        per_chunk = [size // self.vpp for size in self.stage_sizes(num_layers)]
        round_size = sum(per_chunk)  # layers of one virtual round: chunk c of every stage
        start = chunk * round_size + sum(per_chunk[:stage])
        return list(range(start, start + per_chunk[stage]))

    def stage_layers(self, num_layers: int, stage: int) -> list[int]:
        """Global layer ids of pipeline stage `stage`, all its virtual chunks."""
        return [layer for chunk in range(self.vpp) for layer in self.chunk_layers(num_layers, stage, chunk)]

    def check(self, num_layers: int, prefix: str = "") -> None:
        """Raise a UserError naming the keys (`{prefix}pp`, `{prefix}pp_first_stage_layers`, ...) when Megatron
        cannot split `num_layers` this way; the message lists what would be valid."""
        pp, vpp = self.pp, self.vpp
        first_key, last_key = (_key(prefix, name) for name in ("pp_first_stage_layers", "pp_last_stage_layers"))
        if not self.uneven:
            if num_layers % (pp * vpp):
                valid = [p for p in range(1, num_layers + 1) if num_layers % (p * vpp) == 0]
                raise UserError(
                    f"{prefix}pp={pp} x {prefix}vpp={vpp} does not divide num_hidden_layers={num_layers} into equal "
                    f"stages; valid {prefix}pp with vpp={vpp}: {', '.join(map(str, valid)) or 'none'}, or give the "
                    f"first/last stage fewer layers ({first_key}, {last_key})"
                )
            return
        if pp == 1:
            raise UserError(f"{first_key}/{last_key} need pipeline parallelism ({prefix}pp > 1)")
        for key, value in ((first_key, self.first), (last_key, self.last)):
            if value is not None and (value < 1 or value % vpp):
                raise UserError(f"{key}={value} must be a positive multiple of {prefix}vpp={vpp}")
        middle_stages = pp - (self.first is not None) - (self.last is not None)
        middle = num_layers - (self.first or 0) - (self.last or 0)
        if middle_stages == 0 and vpp > 1:  # Megatron's interleaved offset divides by the middle stages
            raise UserError(f"with {prefix}pp=2 and {prefix}vpp={vpp} set only {first_key} (the last stage: the rest)")
        if middle < 0 or bool(middle) != bool(middle_stages) or (middle_stages and middle % (middle_stages * vpp)):
            raise UserError(
                f"{first_key}={self.first} and {last_key}={self.last} leave {middle} of num_hidden_layers="
                f"{num_layers} for {middle_stages} middle stage(s) of {prefix}pp={pp} x {prefix}vpp={vpp}: they must "
                f"split evenly{_suggestion(num_layers, pp, vpp)}"
            )


def _key(prefix: str, name: str) -> str:
    """A key under `prefix` ("actor.model.parallel."), or a command-line flag for the prefix "--"."""
    return f"{prefix}{name.replace('_', '-')}" if prefix.endswith("-") else f"{prefix}{name}"


def _suggestion(num_layers: int, pp: int, vpp: int) -> str:
    """'; e.g. first=6, last=7 with 8 per middle stage': the fullest middle stages whose remainder splits into a
    first and last stage no larger than them."""
    if pp < 3:
        return ""
    for middle_size in range(num_layers // (pp - 2), 0, -1):
        edge = num_layers - middle_size * (pp - 2)
        first = edge // 2 // vpp * vpp
        last = edge - first
        if middle_size % vpp == 0 and last % vpp == 0 and 0 < first <= last <= middle_size:
            return f"; e.g. first={first}, last={last} with {middle_size} per middle stage"
    return ""
