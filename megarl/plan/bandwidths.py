"""The bandwidths and fixed costs the weight-sync estimate (megarl/plan/sync.py) assumes, in one table, with sources.

Three kinds of figure:
- `config`: the cluster's own links, from the job's `plan.*` keys (the defaults are the published H100 figures cited
  here; set yours);
- `published`: a vendor's or another trainer's published number, cited;
- `measured-cpu`: measured on this project's CPU machine by the named benchmark (the tools/bench/README.md row);
- `gpu-kit`: to be measured by the GPU kit (tools/gpu/, tools/bench/gpu_refit.py) when it runs on a GPU; until then
  the estimate uses the published or configured figure beside it.
`megarl plan --json` prints this table under "bandwidths"; the human output names the figures it used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Bandwidth:
    name: str
    road: str
    """The weight-sync road(s) using it."""
    value: float | None
    """GB/s (10^9 bytes), or seconds for a fixed cost (`unit`); None: not measured yet."""
    unit: str
    kind: str
    """config, published, measured-cpu or gpu-kit (see the module docstring)."""
    source: str

    def as_dict(self) -> dict:
        return asdict(self)


HOST_GBPS = 10.0
"""Object-store road on a GPU node: device -> host -> shared memory -> host -> device per sender (a PCIe Gen5 x16
link is 64 GB/s raw; Ray's put and the engine's copy each cross host memory once)."""
BUCKET_OVERHEAD_S = 0.01
"""Fixed cost of one bucket on the engine side (HTTP / IPC round trip plus SGLang's per-call work)."""
CPU_REFIT_GBPS = 5.6
"""tools/bench/refit.py on this project's 2-core CPU machine: 1.02 GB from a TP=2 actor into a CPU hf engine on the
same node, each TP rank writing its own parts into the engine's weights in shared memory, in 0.14-0.19 s
(2026-11-28; 0.31-0.33 s through the object store, 0.62-0.69 s gathered to one rank before 2026-11-28)."""

TABLE: tuple[Bandwidth, ...] = (
    Bandwidth(
        "nvlink",
        "ipc, ipc relay fan-out, nccl inside a node, TP gathers",
        450.0,
        "GB/s per GPU, one direction",
        "config",
        "plan.intra_node_gbps; published: NVIDIA H100 SXM datasheet, NVLink 4 = 900 GB/s per GPU both directions",
    ),
    Bandwidth(
        "infiniband",
        "ipc relay between nodes, nccl across nodes, PP/EP broadcasts",
        50.0,
        "GB/s per GPU",
        "config",
        "plan.inter_node_gbps; published: NVIDIA DGX H100 user guide, 8 x ConnectX-7 400 Gb/s NDR (one per GPU)",
    ),
    Bandwidth(
        "shared_fs",
        "disk",
        20.0,
        "GB/s aggregate",
        "config",
        "plan.shared_fs_gbps (the cluster's file system; an assumption until measured on it)",
    ),
    Bandwidth(
        "host_copy",
        "object_store",
        HOST_GBPS,
        "GB/s per sender",
        "published",
        "PCIe Gen5 x16 = 64 GB/s raw per direction (PCI-SIG); two host crossings per byte, Ray's put single-threaded",
    ),
    Bandwidth(
        "host_copy_cpu",
        "object_store (CPU engines: in place in shared memory)",
        CPU_REFIT_GBPS,
        "GB/s",
        "measured-cpu",
        "python tools/bench/refit.py: 1.02 GB from a TP=2 actor in 0.14-0.19 s on 2 CPU cores (2026-11-28)",
    ),
    Bandwidth(
        "bucket_call",
        "every road (engine side)",
        BUCKET_OVERHEAD_S,
        "s per bucket",
        "gpu-kit",
        "an estimate until tools/bench/gpu_refit.py measures update_weights_from_tensor per bucket on a GPU",
    ),
    Bandwidth(
        "gpu_ipc_measured",
        "ipc",
        None,
        "GB/s",
        "gpu-kit",
        "tools/bench/gpu_refit.py (GPU kit): to be filled when the kit runs on a GPU",
    ),
    Bandwidth(
        "gpu_nccl_measured",
        "nccl",
        None,
        "GB/s",
        "gpu-kit",
        "tools/bench/gpu_refit.py (GPU kit): to be filled when the kit runs on a GPU",
    ),
    Bandwidth(
        "nemo_rl_dsv3",
        "nccl (reference)",
        2.39,
        "s per sync (2.39-2.83)",
        "published",
        "NeMo-RL, DeepSeek-V3 on H100, refit by NCCL reshard (NeMo-RL performance summary)",
    ),
)


def table(intra_gbps: float, inter_gbps: float, shared_fs_gbps: float) -> list[dict]:
    """The table as dicts, with the job's configured links in place of the defaults."""
    configured = {"nvlink": intra_gbps, "infiniband": inter_gbps, "shared_fs": shared_fs_gbps}
    rows = []
    for row in TABLE:
        item = row.as_dict()
        if row.name in configured:
            item["value"] = configured[row.name]
        rows.append(item)
    return rows


def render_table(intra_gbps: float, inter_gbps: float, shared_fs_gbps: float) -> list[str]:
    """The table as lines for the human output."""
    out = [f"  {'figure':<18} {'value':>8} {'unit':<30} {'kind':<13} source"]
    for row in table(intra_gbps, inter_gbps, shared_fs_gbps):
        value = "pending" if row["value"] is None else f"{row['value']:g}"
        out.append(f"  {row['name']:<18} {value:>8} {row['unit']:<30} {row['kind']:<13} {row['source']}")
    return out
