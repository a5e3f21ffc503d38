"""One SGLang HTTP server as a subprocess of the rollout worker: its command line, environment, readiness and shutdown.

The command is `python -m sglang.launch_server` with flags named as in SGLang's `ServerArgs` (checked against sglang
0.5.23, `srt/arg_groups/fields/*.py`: every field `x_y` is the flag `--x-y`, booleans are bare switches). The server
runs in its own process group, so shutdown reaches the scheduler and detokenizer processes it spawns too: SIGTERM to
the group, then SIGKILL after a grace period. Its output goes to a log file whose tail is quoted whenever the server
fails to start or dies.

Readiness is GET /health_generate answering 200 (SGLang answers 503 while starting and generates one token once up),
polled until `startup_timeout_s`; a process that exits meanwhile fails at once with its exit code and log tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.rollout.config import DELTA_LOADER, MANAGED_ARGS, SGLangEngineConfig
from megarl.rollout.sglang_client import SGLangClient, SGLangError
from megarl.runtime.ports import find_free_port

__all__ = [
    "MANAGED_ARGS",
    "NodePlace",
    "SGLangServer",
    "SGLangServerError",
    "build_server_args",
    "build_server_command",
    "build_server_env",
    "find_free_port",
    "has_weight_files",
    "url_of",
]


ENV_REMOVED = ("SGLANG_RETURN_ORIGINAL_LOGPROB",)
"""Environment variables never passed to the server: SGLANG_RETURN_ORIGINAL_LOGPROB would make SGLang return
log-probs before temperature scaling, breaking megarl's log-prob convention (see sglang_engine)."""

ENV_SET = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
"""Environment the server always gets: GET /health answers from the server's state instead of generating a token
(SGLang's default), so health checks neither queue behind a paused or memory-released engine nor touch its cache.
Readiness still uses /health_generate, which does generate."""

ENV_REMOVED_WITH_MEMORY_SAVER = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""A training job's allocator settings (expandable segments) that SGLang's memory saver cannot work with."""

LOG_TAIL_LINES = 40
SHUTDOWN_GRACE_S = 15.0


LOG_DIR_ENV = "MEGARL_LOG_DIR"
"""Where servers write their logs when no path is given: `<it>/sglang/` (the Slurm template points it at the job
folder on shared storage); unset: the node's temp folder, lost with a cluster allocation."""


def _new_log_file() -> str:
    folder = os.environ.get(LOG_DIR_ENV)
    if folder:
        folder = os.path.join(folder, "sglang")
        os.makedirs(folder, exist_ok=True)
    prefix = f"sglang-{socket.gethostname().split('.')[0]}-" if folder else "megarl-sglang-"
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=folder or None)
    os.close(fd)
    return path


class SGLangServerError(SGLangError):
    """The server process failed to start, died, or did not become healthy in time."""


@dataclass(frozen=True)
class NodePlace:
    """Where one server process sits in an engine that spans nodes (SGLang's --nnodes / --node-rank)."""

    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    """host:port of node 0, where the engine's processes meet (needed when nnodes > 1)."""


def build_server_args(
    config: SGLangEngineConfig,
    model_path: str | os.PathLike,
    *,
    host: str,
    port: int,
    base_gpu_id: int = 0,
    load_format: str | None = None,
    node: NodePlace = NodePlace(),
    quantization: dict | None = None,
    return_routed_experts: bool = False,
) -> list[str]:
    """The server's arguments (without the interpreter and module), in a fixed order. `load_format` "dummy" starts
    without reading weights (random values until the first sync). `quantization`: the quantization_config the
    weights arrive in (rollout.weights_format=fp8), given to SGLang as an override of the model's config (the
    rollout folder's config.json describes the bf16 weights megarl trains). `return_routed_experts`: keep the
    experts each token was routed to, for requests that ask (R3, megarl/rollout/routing.py)."""
    args = ["--model-path", str(model_path), "--host", host, "--port", str(port)]
    if load_format is not None:
        args += ["--load-format", load_format]
    args += ["--base-gpu-id", str(base_gpu_id), "--tp-size", str(config.tp)]
    if node.nnodes > 1:
        if not node.dist_init_addr:
            raise ValueError(f"an engine on {node.nnodes} nodes needs dist_init_addr (host:port of its node 0)")
        args += ["--nnodes", str(node.nnodes), "--node-rank", str(node.node_rank)]
        args += ["--dist-init-addr", node.dist_init_addr]
    if config.enable_dp_attention and config.dp > 1:
        args += ["--attn-dp-size", str(config.dp)]
    if config.ep > 1:
        args += ["--ep-size", str(config.ep)]
    if config.mem_fraction_static is not None:
        args += ["--mem-fraction-static", repr(float(config.mem_fraction_static))]
    args += ["--dtype", config.dtype]
    if config.context_length is not None:
        args += ["--context-length", str(config.context_length)]
    if config.random_seed is not None:
        args += ["--random-seed", str(config.random_seed)]
    switches = {
        "--trust-remote-code": config.trust_remote_code,
        "--enable-deterministic-inference": config.deterministic,
        "--enable-memory-saver": config.enable_memory_saver,
        "--skip-server-warmup": config.skip_server_warmup,
        "--enable-return-routed-experts": return_routed_experts,
    }
    args += [flag for flag, on in switches.items() if on]
    # megarl's delta loader (rollout.weight_sync_delta; imported by SGLang only when a delta bucket arrives): named
    # on every server, so an engine can take deltas whichever road a sync takes
    args += ["--custom-weight-loader", DELTA_LOADER]
    overrides = json.loads(config.extra_args.get("json_model_override_args") or "{}")
    if quantization is not None:
        overrides["quantization_config"] = quantization
    if overrides:
        args += ["--json-model-override-args", json.dumps(overrides, sort_keys=True, separators=(",", ":"))]
    for name, value in config.extra_args.items():
        if name == "json_model_override_args":
            continue
        flag = "--" + name.strip("-").replace("_", "-")
        text = str(value).strip()
        if text.lower() in ("", "true"):
            args.append(flag)
        elif text.lower() != "false":
            args += [flag, text]
    return args


def build_server_command(config: SGLangEngineConfig, model_path: str | os.PathLike, **options: Any) -> list[str]:
    """`python -m sglang.launch_server ...` with `config.python` (default: this interpreter); `options` are
    build_server_args' keyword arguments (host, port, base_gpu_id, load_format, node, quantization, ...)."""
    head = [config.python or sys.executable, "-m", "sglang.launch_server"]
    return head + build_server_args(config, model_path, **options)


def has_weight_files(model_path: str | os.PathLike) -> bool:
    """Does the folder hold weights SGLang can load? (A megarl checkpoint's hf/ folder has config and tokenizer.)"""
    folder = Path(model_path)
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")) or any(folder.glob("*.pt"))


def build_server_env(
    config: SGLangEngineConfig,
    gpu_ids: Sequence[int] | None = None,
    base: Mapping[str, str] | None = None,
    nnodes: int = 1,
) -> dict[str, str]:
    """The server's environment: `base` (default: this process's), restricted to `gpu_ids` when given (the GPUs
    of this node: an engine on `nnodes` nodes has tp / nnodes on each).

    With `gpu_ids` the server sees exactly those GPUs (CUDA_VISIBLE_DEVICES) and starts from the first visible one
    (--base-gpu-id 0); without, it inherits the caller's visible devices (e.g. the ones Ray assigned).
    """
    env = dict(os.environ if base is None else base)
    if gpu_ids is not None:
        if len(gpu_ids) * nnodes != config.num_gpus():
            raise ValueError(
                f"an engine with tp={config.tp} on {nnodes} node(s) needs {config.num_gpus() // nnodes} GPUs per node, "
                f"got gpu_ids={gpu_ids}"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpu_ids)
    for name in ENV_REMOVED:
        env.pop(name, None)
    if config.enable_memory_saver:
        for name in ENV_REMOVED_WITH_MEMORY_SAVER:
            env.pop(name, None)
    env.update(ENV_SET)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def url_of(host: str, port: int) -> str:
    """http://host:port, IPv6 hosts in brackets; a wildcard host is reached through loopback."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class SGLangServer:
    """A server subprocess: `start()` launches it and waits until healthy, `stop()` ends its process group."""

    def __init__(
        self,
        command: Sequence[str],
        url: str,
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout_s: float = 600.0,
        poll_interval_s: float = 1.0,
        watch: Callable[[], None] | None = None,
    ) -> None:
        """watch: called at every readiness probe while starting; what it raises ends the start (a multi-node
        engine's check of its other nodes: a node that failed is named at once, not after the timeout)."""
        self.command = list(command)
        self.watch = watch
        self.url = url
        self.env = dict(env) if env is not None else None
        if log_path is None:
            log_path = _new_log_file()
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.poll_interval_s = poll_interval_s
        self.process: subprocess.Popen | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    def start(self, wait_ready: bool = True) -> SGLangServer:
        """Launch and wait until GET /health_generate answers 200. Raises SGLangServerError (exit code and log tail)
        if the process exits or the deadline passes; the process group is stopped in both cases. wait_ready=False
        only launches (a node-rank > 0 process of a multi-node engine, which serves no HTTP)."""
        if self.process is not None:
            raise RuntimeError(f"SGLang server {self.url} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches the workers it spawns
            )
        if not wait_ready:
            return self
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        client = SGLangClient(self.url)
        deadline = time.monotonic() + self.startup_timeout_s
        last_error = "no answer yet"
        while True:
            self.check_alive("while starting")
            if self.watch is not None:
                self.watch()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SGLangServerError(
                    f"SGLang server {self.url} (pid {self.process.pid}) not healthy after "
                    f"{self.startup_timeout_s:g} s (last probe: {last_error}); "
                    f"command: {' '.join(self.command)}\n{self._log_excerpt()}",
                    url=self.url,
                )
            try:
                # /health_generate waits up to ~20 s for one token while the server is busy
                client.health_generate(timeout_s=min(max(remaining, 1.0), 30.0))
                return
            except SGLangError as e:
                last_error = str(e)
            time.sleep(min(self.poll_interval_s, max(deadline - time.monotonic(), 0.0)))

    def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> int | None:
        """SIGTERM to the server's process group, SIGKILL to what is left after `grace_s`; returns the exit code."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace_s)
        # whatever is left in the group (SGLang's schedulers outliving their parent) goes too
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
        return process.returncode

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    # ---- state -----------------------------------------------------------------------------------------------------
    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self, when: str = "", wait_s: float = 0.0) -> None:
        """Raise SGLangServerError with the exit code and log tail if the server process has exited (or exits
        within `wait_s`: a connection dropped by a dying server comes a moment before its exit)."""
        if self.process is None:
            raise SGLangServerError(f"SGLang server {self.url} was never started", url=self.url)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=wait_s)
        code = self.process.poll()
        if code is not None:
            what = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
            raise SGLangServerError(
                f"SGLang server {self.url} (pid {self.process.pid}) {what}{' ' + when if when else ''}; "
                f"command: {' '.join(self.command)}\n{self._log_excerpt()}",
                url=self.url,
            )

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the server's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(f.tell() - 64 * 1024, 0))
                lines = f.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def _log_excerpt(self) -> str:
        tail = self.log_tail()
        return f"last lines of {self.log_path}:\n{tail}" if tail else f"its log {self.log_path} is empty"

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def reap_process_groups(pgids: Sequence[int]) -> None:
    """SIGKILL what is left of a dead engine's own processes on this node (an SGLang server runs in a process group
    of its own, which outlives the worker that started it)."""
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
