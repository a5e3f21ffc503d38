"""Starting or joining Ray, and what the driver knows about the cluster's nodes.

`start_ray` either starts a local instance (the embedded default: one node, logical GPUs on a CPU machine) or joins
a running cluster. Joining checks first that the address answers, within `connect_timeout_s`: `ray.init` on an
unreachable GCS address retries for minutes before failing. `BackgroundStart` starts a local instance in a thread,
so that its processes boot while the driver imports torch and checks the model and data files (on a small machine
each of the two takes seconds).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
from dataclasses import dataclass

import ray

from megarl.cluster.config import ClusterConfig, cuda_available
from megarl.errors import UserError

_THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node and the resources it announces (totals, not what is free)."""

    node_id: str
    ip: str
    num_gpus: float
    num_cpus: float


@dataclass(frozen=True)
class RayInfo:
    """The Ray instance the driver is connected to."""

    address: str
    """GCS address of the instance."""
    namespace: str
    started_locally: bool
    """Whether `start_ray` started this instance (and `stop_ray` ends it) rather than joining one."""
    nodes: tuple[NodeInfo, ...]

    @property
    def num_gpus(self) -> float:
        return sum(node.num_gpus for node in self.nodes)

    @property
    def num_cpus(self) -> float:
        return sum(node.num_cpus for node in self.nodes)

    def describe(self) -> str:
        return describe_nodes(self.nodes)


def thread_env(num_cpus: float) -> dict[str, str]:
    """Environment capping a worker's intra-op threads at its CPU share (at least one thread), so that N workers on
    one node do not each start one thread per core."""
    num_threads = str(max(1, math.floor(num_cpus)))
    return {name: num_threads for name in _THREAD_ENV_VARS} | {"TOKENIZERS_PARALLELISM": "false"}


def cluster_nodes() -> list[NodeInfo]:
    """The alive nodes of the connected cluster, by IP address."""
    nodes = [
        NodeInfo(
            node_id=node["NodeID"],
            ip=node["NodeManagerAddress"],
            num_gpus=node["Resources"].get("GPU", 0.0),
            num_cpus=node["Resources"].get("CPU", 0.0),
        )
        for node in ray.nodes()
        if node["Alive"]
    ]
    return sorted(nodes, key=lambda node: (ip_sort_key(node.ip), node.node_id))


def describe_nodes(nodes: list[NodeInfo] | tuple[NodeInfo, ...]) -> str:
    """One line per node: "node 10.0.0.1: 8 GPUs, 96 CPUs"."""
    return "; ".join(
        f"node {node.ip}: {_count(node.num_gpus, 'GPU')}, {_count(node.num_cpus, 'CPU')}" for node in nodes
    )


def _count(number: float, what: str) -> str:
    return f"{number:g} {what}" + ("s" if number != 1 else "")


def ip_sort_key(ip: str) -> tuple:
    """Orders IPv4 addresses numerically (10.0.0.9 before 10.0.0.10); anything else after them, as text."""
    parts = ip.split(".")
    if len(parts) == 4 and all(part.isdigit() for part in parts):
        return (0, tuple(int(part) for part in parts), "")
    return (1, (), ip)


def start_ray(config: ClusterConfig) -> RayInfo:
    """Start a local Ray instance (`config.address` None) or join a running cluster; return what it holds.

    A driver already connected to Ray (a test session, a notebook) keeps its instance: nothing is started and
    the instance is described as it is. An address that cannot be reached raises `UserError` within
    `config.connect_timeout_s`.
    """
    global _started_locally
    if not ray.is_initialized():
        if config.is_local:
            _start_local(config)
            _started_locally = True
        else:
            _connect(config)
            _started_locally = False
    context = ray.get_runtime_context()
    try:
        gcs_address = context.gcs_address
    except Exception:  # a Ray client connection does not know the GCS address
        gcs_address = config.address or ""
    return RayInfo(
        address=gcs_address,
        namespace=context.namespace,
        started_locally=_started_locally,
        nodes=tuple(cluster_nodes()),
    )


def stop_ray() -> None:
    """Disconnect from Ray; a local instance started by `start_ray` ends with it."""
    global _started_locally
    if ray.is_initialized():
        ray.shutdown()
    _started_locally = False


_started_locally = False


class BackgroundStart:
    """`start_ray(config)` in a thread of its own. `result()` waits for it and hands the instance over to the caller
    (who stops it with `stop_ray`); `close()` stops the instance unless it was handed over, and ends the thread:
    call it when the run ends, whichever way (a run that failed before it took the instance leaves none behind).

    The thread lives until `close()`: Ray starts its local processes with PR_SET_PDEATHSIG, which kills them when
    the *thread* that started them exits."""

    def __init__(self, config: ClusterConfig):
        self._info: RayInfo | None = None
        self._error: BaseException | None = None
        self._taken = False
        self._started = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config,), name="megarl-ray-start")
        self._thread.start()

    def _run(self, config: ClusterConfig) -> None:
        # Ray says it cannot set its SIGTERM handler outside the main thread: megarl installs its own (train's stop
        # signals), which Ray's would otherwise replace.
        worker_logger = logging.getLogger("ray._private.worker")
        quiet = _DropMessage("SIGTERM handler is not set")
        worker_logger.addFilter(quiet)
        try:
            self._info = start_ray(config)
        except BaseException as err:  # re-raised in the caller's thread by result()
            self._error = err
        finally:
            worker_logger.removeFilter(quiet)
            self._started.set()
        self._release.wait()

    def result(self) -> RayInfo:
        self._started.wait()
        if self._error is not None:
            raise self._error
        assert self._info is not None
        self._taken = True
        return self._info

    def close(self) -> None:
        self._started.wait()
        if not self._taken and self._error is None:
            stop_ray()
        self._release.set()
        self._thread.join()


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _start_local(config: ClusterConfig) -> None:
    num_gpus = _local_num_gpus(config)
    num_cpus = config.num_cpus
    if num_cpus is None:
        needed = math.ceil((num_gpus or 0) * config.cpus_per_worker) + 1
        num_cpus = max(os.cpu_count() or 1, needed)
    object_store = config.object_store_memory_mb * 2**20 if config.object_store_memory_mb else None
    ray.init(
        address="local",  # never join an instance named by RAY_ADDRESS: None means "start one"
        logging_level=logging.WARNING,  # not "Started a local Ray instance": megarl says what it starts
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        object_store_memory=object_store,
        namespace=config.namespace,
        include_dashboard=config.include_dashboard,
        log_to_driver=config.log_to_driver,
        runtime_env={"env_vars": thread_env(config.cpus_per_worker)},
        # Ray would start one idle Python worker per CPU for the first driver; megarl's workers each carry their
        # own environment (RANK, ...) and so never reuse them: on a small machine they only take the cores the
        # actors' start-up needs (about a second of CPU each).
        _system_config={"prestart_worker_first_driver": False},
    )


def _local_num_gpus(config: ClusterConfig) -> int | None:
    """GPUs a local instance announces; None lets Ray count the real ones."""
    if config.logical_gpus is not None:
        return config.logical_gpus
    if cuda_available():
        return None
    return config.num_nodes * (config.gpus_per_node or 1)


def check_address_reachable(address: str, timeout_s: float) -> str:
    """The GCS address ("host:port") that `address` ("auto", "host:port", "ray://host:port") names, once something
    answers there within `timeout_s`; `UserError` otherwise."""
    gcs_address = _find_running_cluster() if address == "auto" else address
    host, _, port = gcs_address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as err:
        raise UserError(
            f"cluster.address={address!r}: nothing answers at {host}:{port} within {timeout_s:g} s ({err}); start "
            f"the Ray head first (`ray start --head`), check the address and port, or leave cluster.address unset to "
            f"start a local instance"
        ) from err
    return f"{host}:{port}"


def _connect(config: ClusterConfig) -> None:
    assert config.address is not None
    check_address_reachable(config.address, config.connect_timeout_s)
    try:
        ray.init(
            address=config.address,
            namespace=config.namespace,
            log_to_driver=config.log_to_driver,
            runtime_env={"env_vars": thread_env(config.cpus_per_worker)},
        )
    except ConnectionError as err:
        raise UserError(f"cluster.address={config.address!r}: cannot join the Ray cluster: {err}") from err


def _find_running_cluster() -> str:
    """The GCS address that `address="auto"` means (RAY_ADDRESS, or the cluster last started on this machine)."""
    from ray._private import services  # no public API resolves "auto" without also connecting

    try:
        gcs_address = services.canonicalize_bootstrap_address("auto")
    except Exception as err:  # Ray raises ConnectionError or ValueError depending on what it found
        raise UserError(f"cluster.address='auto': {err}") from err
    if gcs_address is None:
        raise UserError(
            "cluster.address='auto' found no running Ray cluster on this machine (none started with "
            "`ray start --head`, and RAY_ADDRESS is unset); start one, give its address, or leave cluster.address "
            "unset to start a local instance"
        )
    return gcs_address
