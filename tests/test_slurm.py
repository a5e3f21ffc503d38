"""tools/slurm/megarl.sbatch on a real single-node Slurm (Debian's slurmctld + slurmd + munge, started here as root
with a generated slurm.conf in a temporary folder).

The template runs bare metal with two tasks on this machine: two Ray nodes (head + worker) that must both join,
then the entry command. The entry command is a parameter of `run_job` (MEGARL_CMD); today it is a small Ray program
that checks the cluster it joined. Needs root and the packages `slurmctld slurmd slurm-client munge`; skipped with
the reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "tools" / "slurm" / "megarl.sbatch"
DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "srun", "scancel", "scontrol", "sinfo")
SUBMITTED: list[str] = []
"""Ids of the jobs this module submitted."""


PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


def _missing_tools() -> list[str]:
    return [tool for tool in DAEMONS + CLIENTS if shutil.which(tool) is None]


def _install_slurm() -> None:
    """Install Debian's Slurm and munge (about 20 s) so that a fresh CI machine runs this test: nothing by hand."""
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        subprocess.run(install, env=env, capture_output=True, timeout=600)


def _why_no_slurm() -> str | None:
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd/munged needs root"
    if _missing_tools() and shutil.which("apt-get"):
        _install_slurm()
    missing = _missing_tools()
    if missing:
        return f"{', '.join(missing)} not installed and apt-get could not install {' '.join(PACKAGES)}"
    return None


_NO_SLURM = _why_no_slurm()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_NO_SLURM is not None, reason=str(_NO_SLURM))]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _free_port_range(count: int) -> int:
    """The first of `count` consecutive ports nothing listens on now (above Linux's ephemeral range's usual start
    would collide with outgoing connections: take them below it)."""
    for first in range(20000 + os.getpid() % 50 * 200, 32000, count):
        if all(_port_is_free(port) for port in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} free consecutive ports between 20000 and 32000")


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _wait(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@dataclass
class SlurmCluster:
    """slurmctld, slurmd and munged of our own: own ports, sockets, state and logs under `root`."""

    root: Path
    procs: list[subprocess.Popen]

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True, cwd: Path | None = None, extra_env: dict | None = None) -> str:
        env = {**self.env, **(extra_env or {})}
        done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=cwd, timeout=60)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key=value pairs ({} once the job is forgotten)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    @classmethod
    def start(cls, root: Path) -> SlurmCluster:
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)  # munged refuses group/world-writable folders
        (root / "munge.key").write_bytes(os.urandom(1024))
        (root / "munge.key").chmod(0o400)
        for name in ("state", "spool"):
            (root / name).mkdir(exist_ok=True)
        host = socket.gethostname().split(".")[0]
        hardware = subprocess.run(["slurmd", "-C"], capture_output=True, text=True).stdout.splitlines()[0]
        cpus = int(next(f for f in hardware.split() if f.startswith("CPUs=")).split("=")[1])
        munge_socket = root / "munge.socket"
        # cred_expire: how long a requeued job waits before it may start again (Slurm's default 120 s)
        (root / "slurm.conf").write_text(
            f"""ClusterName=megarl-test
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=20
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core

JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName={host} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        )
        console = open(root / "daemons.out", "ab")  # noqa: SIM115 (open for the daemons' lifetime)
        procs = [
            subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={munge_socket}",
                    f"--key-file={root}/munge.key",
                    f"--pid-file={root}/munged.pid",
                    f"--log-file={root}/munged.log",
                    f"--seed-file={root}/munge.seed",
                ],
                stdout=console,
                stderr=console,
            )
        ]
        cluster = cls(root, procs)
        _wait(munge_socket.exists, 20, "munged's socket")
        env = cluster.env
        for daemon in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
            procs.append(subprocess.Popen([*daemon, "-f", str(cluster.conf)], env=env, stdout=console, stderr=console))
        try:
            _wait(lambda: "idle" in cluster.run("sinfo", "-h", "-o", "%t", check=False), 60, "the node to be idle")
        except TimeoutError:
            cluster.stop()
            raise RuntimeError(f"Slurm did not come up:\n{cluster.logs()}") from None
        return cluster

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def job_processes(job_id: str) -> list[str]:
    """Processes started by the job: their environment holds SLURM_JOB_ID=<id> (Ray workers inherit it too)."""
    found = []
    marker = f"SLURM_JOB_ID={job_id}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            if marker in environ.split(b"\0"):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{pid}: {command[:120]}")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def run_job(
    slurm: SlurmCluster,
    tmp_path: Path,
    command: str,
    config: Path,
    *overrides: str,
    tasks: int = 2,
    cpus_per_task: int = 1,
    **settings: str,
) -> tuple[str, Path]:
    """Submit the template from an unrelated folder: `tasks` tasks (Ray nodes) on this machine, `command` as the
    entry command (MEGARL_CMD), `settings` as further environment (MEGARL_*). Returns (job id, job folder)."""
    job_dir = tmp_path / "job"
    submit_dir = tmp_path / "elsewhere"
    ports = _free_port_range(420)  # 2 Ray nodes x 6 fixed ports (10 apart), then 2 x 200 worker ports
    submit_dir.mkdir()
    env = {
        "MEGARL_CMD": command,
        "MEGARL_JOB_DIR": str(job_dir),
        "MEGARL_RAY_WAIT_S": "120",
        "MEGARL_RAY_START_ARGS": "--object-store-memory=100000000",
        # other Ray clusters may run on this machine: ports of our own (the template fixes them all)
        "MEGARL_RAY_NODE_PORTS": str(ports),
        "MEGARL_RAY_WORKER_PORTS": str(ports + 20),
        "MEGARL_RAY_WORKER_PORTS_PER_NODE": "200",
        "MEGARL_RAY_PORT": str(_free_port()),
        "MEGARL_RAY_CLIENT_PORT": str(_free_port()),
        "RAY_ADDRESS": "",  # the test process' own Ray (if any) must not leak into the job
        **settings,
    }
    out = slurm.run(
        "sbatch",
        "--parsable",
        "--nodes=1",
        f"--ntasks={tasks}",
        f"--ntasks-per-node={tasks}",
        f"--cpus-per-task={cpus_per_task}",
        str(TEMPLATE),
        str(config),
        *overrides,
        cwd=submit_dir,
        extra_env=env,  # sbatch passes its environment to the job
    )
    job_id = out.strip().split(";")[0]
    SUBMITTED.append(job_id)
    return job_id, job_dir


def wait_done(slurm: SlurmCluster, job_id: str, timeout_s: float) -> dict[str, str]:
    finished = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    return _wait(lambda: (job := slurm.job(job_id)) and job.get("JobState") in finished and job, timeout_s, "the job")


@pytest.fixture(autouse=True)
def _remove_ray_session_folders():
    """The template leaves Ray's logs in /tmp/ray-<job id> on each node (for post-mortems); remove our jobs' ones."""
    yield
    while SUBMITTED:
        shutil.rmtree(f"/tmp/ray-{SUBMITTED.pop()}", ignore_errors=True)


CHECK_CLUSTER = """
import json, sys, time
import ray
ray.init(address="auto")
nodes = [n for n in ray.nodes() if n["Alive"]]
result = {"argv": sys.argv[1:], "nodes": len(nodes), "cpus": ray.cluster_resources().get("CPU")}
@ray.remote(num_cpus=1)
def where():
    return ray.get_runtime_context().get_node_id()
result["task_nodes"] = len(set(ray.get([where.remote() for _ in range(8)])))
json.dump(result, open(sys.argv[sys.argv.index("--out") + 1], "w"))
sys.exit(0 if result["nodes"] == 2 and result["cpus"] == 2 else 3)
"""


def test_template_forms_a_ray_cluster_and_runs_the_command(slurm, tmp_path):
    program = tmp_path / "check_cluster.py"
    program.write_text(CHECK_CLUSTER)
    config = tmp_path / "job.yaml"
    config.write_text("run: {name: slurm-test}\n")
    out = tmp_path / "result.json"
    job_id, job_dir = run_job(slurm, tmp_path, f"{sys.executable} {program} --out {out}", config, "rl.num_steps=2")
    job = wait_done(slurm, job_id, 240)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((job_dir / "logs").glob("*.log")))
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", f"{job}\n{logs}"
    result = json.loads(out.read_text())
    assert result["nodes"] == 2 and result["cpus"] == 2
    assert result["argv"][2:] == ["--config", str(config), "rl.num_steps=2", "cluster.address=auto"]
    assert "all 2 Ray nodes joined" in (job_dir / "logs" / "sbatch.log").read_text()
    assert (job_dir / "config.yaml").read_text() == config.read_text()
    _wait(lambda: not job_processes(job_id), 60, "the job's processes to exit")


SLEEP_FOREVER = """
import pathlib, sys, time
import ray
ray.init(address="auto")
@ray.remote
class Sleeper:
    def ping(self):
        return "pong"
sleepers = [Sleeper.remote() for _ in range(2)]
ray.get([s.ping.remote() for s in sleepers])
pathlib.Path(sys.argv[1]).write_text("ready")
while True:
    time.sleep(1)
"""


def test_scancel_shuts_ray_down_and_leaves_nothing(slurm, tmp_path):
    program = tmp_path / "sleep_forever.py"
    program.write_text(SLEEP_FOREVER)
    ready = tmp_path / "ready"
    config = tmp_path / "job.yaml"
    config.write_text("run: {name: slurm-cancel}\n")
    job_id, job_dir = run_job(slurm, tmp_path, f"{sys.executable} {program} {ready}", config)
    try:
        _wait(ready.exists, 240, "the entry command to start its Ray workers")
    except TimeoutError:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((job_dir / "logs").glob("*.log")))
        raise AssertionError(f"{slurm.job(job_id)}\n{logs}") from None
    assert any("ray::Sleeper" in p for p in job_processes(job_id)), job_processes(job_id)
    slurm.run("scancel", job_id)
    job = wait_done(slurm, job_id, 120)
    assert job["JobState"] == "CANCELLED"
    # Slurm kills what is left KillWait (30 s) after SIGTERM; the template must have stopped Ray by itself sooner.
    _wait(lambda: not job_processes(job_id), 60, "the job's processes to exit")
    log = (job_dir / "logs" / "sbatch.log").read_text()
    # Either the script's TERM trap or, when the SIGTERM reaches the entry command first, its exit (143) starts the
    # shutdown; both must stop Ray on every node and finish before Slurm's SIGKILL. (scancel signals the Ray step
    # too: under load it may have stopped its nodes before the trap looks, which the log then says.)
    assert "stopping Ray on every node" in log or "Ray had already stopped on every node" in log, log
    assert "done (exit status 143)" in log, log


def test_a_node_that_never_joins_is_named(slurm, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("run: {name: slurm-missing}\n")
    marker = tmp_path / "entry-ran"
    job_id, job_dir = run_job(
        slurm,
        tmp_path,
        f"touch {marker}",
        config,
        MEGARL_SETUP="[[ ${SLURM_PROCID:-0} == 1 ]] && exit 3",  # the second Ray node fails before `ray start`
        MEGARL_RAY_WAIT_S="25",  # the head itself must be up by then on a loaded machine
    )
    job = wait_done(slurm, job_id, 180)
    log = (job_dir / "logs" / "sbatch.log").read_text()
    assert job["JobState"] == "FAILED", log
    host = socket.gethostname().split(".")[0]
    assert f"Ray nodes missing after 25 s: {host} (1 of 2)" in log
    assert not marker.exists()  # the entry command never ran
    _wait(lambda: not job_processes(job_id), 60, "the job's processes to exit")


def test_time_limit_warning_checkpoints_requeues_and_the_next_start_resumes(slurm, tmp_path):
    """Preemption as on a real cluster, with the real trainer: a GRPO run under the template gets Slurm's warning
    before the time limit (the template's `--signal=B:USR1@300` signals the batch script alone, as `scancel --batch
    --signal=USR1` does here), forwards it to `megarl train`, which finishes its step, saves and exits 75; the
    template stops Ray and requeues the job, and its second start (same job id, same job folder) resumes from that
    checkpoint to the last step. One Ray node of 2 CPUs announcing 2 GPUs (gloo workers, TP=2)."""
    from job_helpers import metrics, write_config

    config, run = write_config(tmp_path, "[grpo]", 6), tmp_path / "run"
    job_id, job_dir = run_job(
        slurm,
        tmp_path,
        f"{sys.executable} -m megarl.cli train",
        config,
        tasks=1,
        cpus_per_task=2,
        MEGARL_RAY_START_ARGS="--num-gpus=2 --object-store-memory=200000000",
    )
    logs = lambda: "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((job_dir / "logs").glob("*.log")))  # noqa: E731
    try:
        _wait(lambda: (run / "metrics.jsonl").is_file() and metrics(run), 300, "the first step")
    except TimeoutError:
        raise AssertionError(f"{slurm.job(job_id)}\n{logs()}") from None
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)
    try:
        _wait(lambda: slurm.job(job_id).get("Restarts") == "1", 240, "the job to be requeued")
    except TimeoutError:
        raise AssertionError(f"{slurm.job(job_id)}\n{logs()}") from None
    finished = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    try:
        job = _wait(
            lambda: (j := slurm.job(job_id)) and j.get("Restarts") == "1" and j.get("JobState") in finished and j,
            600,
            "the requeued job to finish",
        )
    except TimeoutError:
        raise AssertionError(f"{slurm.job(job_id)}\n{logs()}") from None
    log = (job_dir / "logs" / "sbatch.log").read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", f"{job}\n{logs()}"
    assert "time limit near (SIGUSR1): asking the entry command to save a checkpoint and stop" in log, log
    assert "entry command exited with status 75" in log and "requeueing the job" in log, log
    assert f"job {job_id} (start 2)" in log and "entry command exited with status 0" in log, log
    stopped = int(
        re.search(
            r"SIGUSR1: stopping after this step.*\n(?:.*\n)*?.*checkpoint saved at step (\d+)",
            (job_dir / "logs" / "driver.log").read_text(),
        ).group(1)
    )
    assert 1 <= stopped < 6
    assert [s["step"] for s in metrics(run)] == list(range(1, 7))  # every step once: resumed, not restarted
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_6"
    for start in (1, 2):  # each start copied its node's Ray logs (raylet, GCS, workers) to the job folder
        assert (
            job_dir / "logs" / "ray" / f"start-{start}" / f"{socket.gethostname().split('.')[0]}-0" / "raylet.out"
        ).is_file()
    _wait(lambda: not job_processes(job_id), 60, "the job's processes to exit")


SRUN_SHIM = """#!/bin/bash
# pyxis stand-in: record every srun call's container options, run the step with the real srun without them
line="$*"
printf '%s %s\\n' "$(date +%s.%N)" "${line//$'\\n'/ }" >> "$SHIM_LOG"   # one line per call
args=()
for arg in "$@"; do
    case $arg in --container-*|--no-container-mount-home) ;; *) args+=("$arg") ;; esac
done
exec "$REAL_SRUN" "${args[@]}"
"""


def test_with_a_container_each_node_creates_it_once_before_the_concurrent_steps(slurm, tmp_path):
    """pyxis races when concurrent steps create the same named container: the template creates the container once
    per node in a step of its own, and every later step (the Ray nodes, the wait, the entry command, running at the
    same time) joins it by name. With a container the entry command runs under `srun`: Slurm's SIGUSR1 must still
    reach it (srun forwards it). No pyxis here: an `srun` shim on PATH records each step's container options and
    runs it with the real srun without them."""
    shim_dir = tmp_path / "shim"
    shim_dir.mkdir()
    (shim_dir / "srun").write_text(SRUN_SHIM)
    (shim_dir / "srun").chmod(0o755)
    calls = tmp_path / "srun_calls.log"
    program = tmp_path / "wait_for_usr1.py"
    program.write_text(WAIT_FOR_USR1)
    config = tmp_path / "job.yaml"
    config.write_text("run: {name: slurm-container}\n")
    ready, got = tmp_path / "ready", tmp_path / "got"
    job_id, job_dir = run_job(
        slurm,
        tmp_path,
        f"{sys.executable} {program} {ready} {got}",
        config,
        MEGARL_CONTAINER_IMAGE="/images/megarl.sqsh",
        MEGARL_CONTAINER_MOUNTS="/lustre/data:/data:ro",
        PATH=f"{shim_dir}:{os.environ['PATH']}",
        SHIM_LOG=str(calls),
        REAL_SRUN=shutil.which("srun"),
    )
    log = lambda: (job_dir / "logs" / "sbatch.log").read_text()  # noqa: E731
    try:
        _wait(ready.exists, 240, "the entry command to start")
    except TimeoutError:
        raise AssertionError(f"{slurm.job(job_id)}\n{log()}") from None
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)
    job = wait_done(slurm, job_id, 240)
    assert job["JobState"] == "COMPLETED", (job, log())
    assert got.read_text() == "SIGUSR1 after joining 2 Ray nodes"  # through the template and srun
    steps = [line.split(" ", 1)[1] for line in calls.read_text().splitlines()]
    name = f"--container-name=megarl-{job_id}-0"
    create, *joins = steps
    assert "--container-image=/images/megarl.sqsh" in create and name in create and create.endswith(" true")
    assert "--ntasks-per-node=1" in create  # once per node
    assert len(joins) == 3  # the Ray nodes, the wait for them, the entry command
    for step in joins:
        assert name in step and "--container-image" not in step, step
        assert f"--container-mounts={job_dir}:{job_dir},{tmp_path}:{tmp_path},/lustre/data:/data:ro" in step
    _wait(lambda: not job_processes(job_id), 60, "the job's processes to exit")


WAIT_FOR_USR1 = """
import pathlib, signal, sys, time
import ray
ray.init(address="auto")
nodes = len([n for n in ray.nodes() if n["Alive"]])
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
pathlib.Path(sys.argv[1]).write_text("ready")
deadline = time.monotonic() + 120
while not got and time.monotonic() < deadline:
    time.sleep(0.2)
pathlib.Path(sys.argv[2]).write_text(f"SIGUSR1 after joining {nodes} Ray nodes" if got else "no signal")
"""
