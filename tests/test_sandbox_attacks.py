"""An adversarial corpus against the Python code tool: each test is one attack model-written code could make, run
for real in the sandbox, with one pass criterion, the exact contained outcome.

The policy is the adversary: RL rewards whatever works. The attacks read and write the host's files, try the
chroot escape, mounts, namespaces, tracing, kernel interfaces and other ABIs, reach the host's sockets, devices and
processes, and exhaust processes, CPU, memory, disk, output and time. The whole corpus skips, with the reason, on a
host that cannot isolate code (no user namespaces): the tool refuses to run there. The parser's, the calculator's
and the environment's attacks are in their own test files.
"""

from __future__ import annotations

import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from megarl.agents.code_tool import CodeToolConfig, check_sandbox, run_python
from megarl.agents.sandbox.seccomp import SYSCALLS
from megarl.errors import UserError

LIMITS = CodeToolConfig(cpu_seconds=1, wall_seconds=30, memory_mb=256, disk_mb=16, max_processes=16)
SLOW = CodeToolConfig(cpu_seconds=1, wall_seconds=60, memory_mb=4096, disk_mb=16, max_processes=16)
"""For the attacks another limit must stop: a wall time that a loaded CI machine cannot reach first, and room for
1000 threads' stacks and malloc arenas (64 MiB of address space each)."""


@pytest.fixture(scope="module", autouse=True)
def isolation():
    try:
        check_sandbox()
    except UserError as e:
        pytest.skip(str(e))


def attempt(statement: str, limits: CodeToolConfig = LIMITS, sandbox: Path | None = None) -> str:
    """Run `statement` in the sandbox; 'done' or the name and errno of what it raised."""
    body = "\n".join("    " + line for line in statement.splitlines())
    code = (
        "import ctypes, os, socket, stat, subprocess, sys, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"try:\n{body}\n    print('done')\n"
        "except Exception as e:\n    print(type(e).__name__, getattr(e, 'errno', None))\n"
    )
    return run_python(code, limits, sandbox)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --- the host's files: none is visible, none is writable ---


def test_etc_shadow_is_not_there():
    assert attempt("open('/etc/shadow').read()") == "FileNotFoundError 2\n"


def test_the_home_folder_is_not_there():
    assert attempt(f"open({str(Path.home() / '.bashrc')!r}).read()") == "FileNotFoundError 2\n"


def test_the_project_source_is_not_there():
    assert attempt(f"open({__file__!r}).read()") == "FileNotFoundError 2\n"


def test_the_supervisors_environment_is_closed():
    assert attempt("open('/proc/1/environ').read()") == "PermissionError 13\n"


def test_no_host_path_shows_in_mounts_environment_or_cwd(tmp_path):
    (tmp_path / "input.txt").write_text("x")
    host = [str(tmp_path), str(Path(__file__).parents[1]), str(Path.cwd())]
    code = (
        "import os\n"
        "seen = open('/proc/self/mountinfo').read() + repr(dict(os.environ)) + os.getcwd()\n"
        f"print([path for path in {host!r} if path in seen])"
    )
    assert run_python(code, LIMITS, tmp_path) == "[]\n"


def test_a_host_file_cannot_be_overwritten(tmp_path):
    target = tmp_path / "host.txt"
    target.write_text("original")
    out = attempt(f"open({str(target)!r}, 'w').write('owned')")
    assert (out, target.read_text()) == ("FileNotFoundError 2\n", "original")


def test_no_pth_file_can_be_planted_in_site_packages():
    target = Path(sysconfig.get_paths()["purelib"]) / f"megarl-attack-{uuid.uuid4().hex}.pth"
    out = attempt(f"open({str(target)!r}, 'w').write('import os; os.system(\"id\")')")
    assert (out, target.exists()) == ("OSError 30\n", False)  # EROFS: the interpreter's prefix is read-only


def test_the_interpreters_bytecode_cache_cannot_be_poisoned():
    cache = Path(os.__file__).parent / "__pycache__" / f"megarl-attack-{uuid.uuid4().hex}.pyc"
    assert (attempt(f"open({str(cache)!r}, 'wb').write(b'x')"), cache.exists()) == ("OSError 30\n", False)


def test_the_root_is_read_only():
    assert attempt("os.makedirs('/.x')") == "OSError 30\n"


def test_the_chroot_escape_of_the_issue_is_refused():
    escape = (
        "os.makedirs('/tmp/.x'); fd = os.open('/', os.O_RDONLY); os.chroot('/tmp/.x'); os.fchdir(fd)\n"
        "[os.chdir('..') for _ in range(128)]; os.chroot('.'); print(open('/etc/shadow').read())"
    )
    assert attempt(escape) == "PermissionError 1\n"


def test_usr_cannot_be_remounted_writable():
    # MS_REMOUNT | MS_BIND: `mount -o remount,rw,bind /usr` through the C library
    assert attempt("print(libc.mount(b'none', b'/usr', None, 32 | 4096, None), ctypes.get_errno())") == "-1 1\ndone\n"


def test_sysfs_cannot_be_mounted():
    assert attempt("print(libc.mount(b'sysfs', b'/tmp', b'sysfs', 0, None), ctypes.get_errno())") == "-1 1\ndone\n"


def test_global_sysctls_are_read_only():
    # core_pattern is run by the kernel as root on a crash: writable, it is a host escape
    assert attempt("os.open('/proc/sys/kernel/core_pattern', os.O_WRONLY)") == "OSError 30\n"


def test_the_setuid_mount_binary_gains_nothing():
    run = "r = subprocess.run(['mount', '-t', 'tmpfs', 'none', '/tmp'], capture_output=True, text=True)\n"
    assert attempt(run + "print(r.returncode, r.stderr.splitlines()[0])") == (
        "32 mount: /tmp: must be superuser to use mount.\ndone\n"
    )


# --- the kernel interfaces an escape needs: refused by the seccomp filter (EPERM) ---

CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
REFUSED_CALLS = {
    "unshare": "libc.unshare(0x10000000)",
    "setns": "libc.setns(os.open('/proc/self/ns/user', os.O_RDONLY), 0)",
    "clone_newuser": f"libc.syscall({SYSCALLS['clone'][0]}, {CLONE_NEWUSER | SIGCHLD}, 0, 0, 0, 0)",
    "ptrace": "libc.ptrace(16, 1, 0, 0)",  # PTRACE_ATTACH to the supervisor
    "process_vm_readv": "libc.process_vm_readv(1, None, 0, None, 0, 0)",
    "keyctl": f"libc.syscall({SYSCALLS['keyctl'][0]}, 0, 0, 0, 0, 0)",
    "add_key": f"libc.syscall({SYSCALLS['add_key'][0]}, b'user', b'k', b'v', 1, -2)",
    "bpf": f"libc.syscall({SYSCALLS['bpf'][0]}, 0, None, 0)",
    "perf_event_open": f"libc.syscall({SYSCALLS['perf_event_open'][0]}, None, 0, -1, -1, 0)",
    "userfaultfd": f"libc.syscall({SYSCALLS['userfaultfd'][0]}, 0)",
    "io_uring_setup": f"libc.syscall({SYSCALLS['io_uring_setup'][0]}, 8, None)",
    "open_by_handle_at": f"libc.syscall({SYSCALLS['open_by_handle_at'][0]}, -100, None, 0)",
    "init_module": f"libc.syscall({SYSCALLS['init_module'][0]}, None, 0, b'')",
    "kexec_load": f"libc.syscall({SYSCALLS['kexec_load'][0]}, 0, 0, None, 0)",
    "reboot": "libc.reboot(0x4321FEDC)",  # RB_POWER_OFF
    "swapon": "libc.swapon(b'/tmp/swap', 0)",
    "syslog": "libc.klogctl(3, None, 0)",  # read the kernel log
    "acct": "libc.acct(b'/tmp/acct')",
    "personality": "libc.personality(0x0400000)",  # READ_IMPLIES_EXEC
    "memfd_create": "libc.memfd_create(b'm', 0)",
    "shmget": "libc.shmget(0, 2**20, 0o1600)",  # IPC_PRIVATE | IPC_CREAT
    "setpriority": "libc.setpriority(0, 1, 19)",  # starve the supervisor
}


@pytest.fixture(scope="module")
def refused_calls() -> dict[str, str]:
    """Every call of REFUSED_CALLS tried in one sandbox: name -> 'return value errno'."""
    code = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n" + "".join(
        f"ctypes.set_errno(0)\nprint({name!r}, {call}, ctypes.get_errno())\n" for name, call in REFUSED_CALLS.items()
    )
    out = run_python(code, LIMITS)
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines()}


@pytest.mark.parametrize("name", list(REFUSED_CALLS))
def test_the_call_is_refused(refused_calls, name):
    assert refused_calls[name] == "-1 1"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the i386 and x32 ABIs are x86_64's")
def test_the_i386_abi_is_refused():
    # getpid through `int 0x80`: mov eax, 20; int 0x80; ret, run from an executable page
    code = (
        "import ctypes, mmap\n"
        "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
        "page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))\n"
        "address = ctypes.addressof(ctypes.c_char.from_buffer(page))\n"
        "print(ctypes.CFUNCTYPE(ctypes.c_int)(address)())\n"
    )
    assert run_python(code, LIMITS) == "-1\n"  # -EPERM in eax


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the i386 and x32 ABIs are x86_64's")
def test_the_x32_abi_is_refused():
    assert attempt("print(libc.syscall(39 | 0x40000000), ctypes.get_errno())") == "-1 1\ndone\n"


# --- processes: the supervisor and the host's are out of reach ---


def test_the_supervisor_ignores_kill():
    assert attempt("os.kill(1, 9); time.sleep(0.2); print('alive')") == "alive\ndone\n"


def test_the_supervisors_memory_is_closed():
    assert attempt("open('/proc/1/mem', 'rb')") == "PermissionError 13\n"


def test_the_supervisors_root_and_cwd_are_closed():
    assert attempt("print(os.listdir('/proc/1/root'))") == "PermissionError 13\n"


def test_the_supervisors_status_descriptor_is_closed():
    assert attempt("open('/proc/1/fd/3', 'w').write('{}')") == "PermissionError 13\n"


def test_host_processes_are_invisible():
    assert attempt("print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [1, os.getpid()])") == (
        "True\ndone\n"
    )


# --- network: no way out, not even to the host's own sockets ---


def test_a_unix_socket_on_the_host_is_unreachable(tmp_path):
    path = str(tmp_path / "host.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen()
        assert attempt(f"socket.socket(socket.AF_UNIX).connect({path!r})") == "FileNotFoundError 2\n"


def test_an_abstract_unix_socket_on_the_host_is_unreachable():
    name = f"\0megarl-attack-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(name)
        listener.listen()
        assert attempt(f"socket.socket(socket.AF_UNIX).connect({name!r})") == "ConnectionRefusedError 111\n"


def test_a_tcp_listener_on_the_hosts_loopback_is_unreachable():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert attempt(f"socket.create_connection(('127.0.0.1', {port}), timeout=1)") == (
            "ConnectionRefusedError 111\n"
        )


def test_the_internet_is_unreachable():
    assert attempt("socket.create_connection(('1.1.1.1', 53), timeout=1)") == "OSError 101\n"


# --- devices ---


def test_dev_holds_no_block_device_nor_memory():
    expected = "['core', 'fd', 'full', 'null', 'ptmx', 'pts', 'random', 'shm', 'stderr', 'stdin', 'stdout', 'tty', "
    assert attempt("print(sorted(os.listdir('/dev')))") == expected + "'urandom', 'zero']\ndone\n"


def test_dev_mem_is_not_there():
    assert attempt("open('/dev/mem', 'rb')") == "FileNotFoundError 2\n"


def test_a_block_device_cannot_be_made():
    assert attempt("os.mknod('/tmp/disk', stat.S_IFBLK | 0o600, os.makedev(8, 0))") == "PermissionError 1\n"


# --- resources: every limit holds over all the code's processes ---


def test_a_fork_bomb_stops_at_the_process_limit():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    assert run_python(bomb, SLOW) == "\nstopped: process limit (16)"


def test_a_thousand_processes_stop_at_the_process_limit():
    code = (
        "import subprocess, sys, time\n"
        "for _ in range(1000):\n"
        "    try:\n"
        "        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "    except OSError:\n"
        "        time.sleep(30)\n"
    )
    assert run_python(code, SLOW) == "\nstopped: process limit (16)"


def test_a_thousand_threads_stop_at_the_process_limit():
    code = (
        "import threading, time\n"
        "for _ in range(1000):\n"
        "    try:\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "    except RuntimeError:\n"
        "        time.sleep(30)\n"
    )
    assert run_python(code, SLOW) == "\nstopped: process limit (16)"


def test_forked_spinners_share_one_cpu_budget():
    code = "import os\nfor _ in range(5):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass\n"
    before = children_cpu()
    out = run_python(code, SLOW)
    # 6 spinners: 1 s in all (the supervisor looks every 20 ms), plus the two interpreters' start-up
    assert (out, children_cpu() - before < 1.6) == ("\nstopped: CPU time limit (1 s)", True)


def test_filling_every_tmpfs_counts_as_memory():
    fill = (
        "for place in ['/tmp', '/dev/shm', '/sandbox']:\n"
        "    for i in range(64):\n"
        "        try:\n"
        "            open(f'{place}/{i}', 'wb').write(bytes(2**20))\n"
        "        except OSError:\n"
        "            break\n"
        "time.sleep(30)\n"
    )
    limits = CodeToolConfig(cpu_seconds=5, wall_seconds=60, memory_mb=100, disk_mb=64)
    assert run_python("import time\n" + fill, limits) == "\nstopped: memory limit (100 MiB)"


def test_shared_memory_of_several_processes_counts_as_memory():
    # each of 4 processes holds 80 MiB of shared anonymous memory: within its own address space limit, 320 in all
    code = (
        "import mmap, os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        break\n"
        "block = mmap.mmap(-1, 80 * 2**20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)\n"
        "block.write(b'x' * 80 * 2**20)\n"
        "time.sleep(30)\n"
    )
    limits = CodeToolConfig(cpu_seconds=5, wall_seconds=60, memory_mb=200)
    assert run_python(code, limits) == "\nstopped: memory limit (200 MiB)"


def test_a_gibibyte_write_stops_at_the_disk_limit():
    write = (
        "f = open('big', 'wb')\n"
        "for i in range(1024):\n"
        "    try:\n"
        "        f.write(bytes(2**20)); f.flush()\n"
        "    except OSError as e:\n"
        "        print(e.errno, os.path.getsize('big') // 2**20); break\n"
    )
    # ENOSPC: the working folder is a tmpfs of disk_mb (16 MiB, main.py included); no byte reaches the host's disk
    assert attempt(write) == "28 15\ndone\n"


def test_printing_128_mib_is_cut_and_read_with_a_bound():
    tracemalloc.start()
    try:
        out = run_python("import sys\nfor _ in range(128):\n    sys.stdout.write('x' * 2**20)", LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    expected = "x" * 2000 + "\n... (output cut at 2000 characters)\nstopped: output limit (2000 characters)"
    assert (out, peak < 2**20) == (expected, True)


def test_an_endless_slow_print_stops_at_the_wall_time():
    limits = CodeToolConfig(wall_seconds=3)
    start = time.perf_counter()
    out = run_python("import time\nwhile True:\n    print('x', flush=True)\n    time.sleep(0.01)", limits)
    assert (out.splitlines()[-1], time.perf_counter() - start < 3 + 3) == ("stopped: wall time limit (3 s)", True)


def test_standard_input_is_empty():
    assert attempt("print(repr(sys.stdin.read()))") == "''\ndone\n"


def test_the_environment_is_the_sandboxs_own(monkeypatch):
    monkeypatch.setenv("MEGARL_SECRET", "hunter2")
    expected = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "LANG": "C.UTF-8", "PWD": "/sandbox"}
    assert attempt("print(dict(os.environ))") == f"{expected}\ndone\n"


def test_a_call_leaves_nothing_in_the_host_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    run_python("open('/tmp/x', 'w').write('x')", LIMITS)
    assert list(tmp_path.iterdir()) == []


def test_forged_status_lines_are_plain_output():
    code = "print('{\"limit\": null, \"exit\": 0}')\nprint('megarl-signal 9')\nraise SystemExit(3)"
    assert run_python(code, LIMITS) == '{"limit": null, "exit": 0}\nmegarl-signal 9\n\nexit code 3'


def test_killing_the_caller_mid_call_leaves_no_process():
    marker = f"megarl-attack-{uuid.uuid4().hex}"
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "print('started', flush=True)\ntime.sleep(60)\n"
    )
    caller_source = (
        "import sys\nfrom megarl.agents.code_tool import CodeToolConfig, run_python\n"
        "run_python(sys.stdin.read(), CodeToolConfig(wall_seconds=30))\n"
    )
    caller = subprocess.Popen([sys.executable, "-c", caller_source], stdin=subprocess.PIPE)
    caller.stdin.write(code.encode())
    caller.stdin.close()

    def running() -> list[str]:
        return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()

    deadline = time.monotonic() + 30
    while not running() and time.monotonic() < deadline:
        time.sleep(0.1)
    started = len(running())
    os.kill(caller.pid, signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 3
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (started, running()) == (1, [])
