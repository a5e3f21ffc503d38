"""The seccomp filter of the code tool's sandbox, as a classic-BPF program for bubblewrap's `--seccomp FD`.

bubblewrap reads the program (an array of `struct sock_filter`) from the descriptor and installs it, with
`no_new_privs`, on the sandboxed process before it runs the command; every process the code starts inherits it.
The program refuses, with EPERM, the system calls model-written code has no use for and that an escape needs:
mounts and namespaces (the calls that would undo the sandbox), tracing and reading other processes' memory, kernel
keyrings, BPF, perf, userfaultfd and io_uring (large kernel attack surface), modules, kexec, reboot, swap, the
kernel log, the clock, file handles that open files by inode (the classic container escape), lowering the
supervisor's scheduling priority, and memory the sandbox's accounting does not see (memfd, SysV shared memory).
`clone` is allowed without namespace flags (threads and fork need it); `clone3`, whose flags sit in a struct a
filter cannot read, answers ENOSYS so that the C library falls back to `clone`. A call from another ABI (i386 by
`int 0x80`, x32) is refused whole: its numbers are not the table's.

No library builds it (libseccomp would be a system dependency); the program is short and tested in
tests/test_code_tool.py and, through the sandbox, in tests/test_sandbox_attacks.py.
"""

from __future__ import annotations

import errno
import platform
import struct

# classic BPF opcodes (linux/filter.h) and seccomp constants (linux/seccomp.h, linux/audit.h)
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = the 32-bit word at offset k of struct seccomp_data
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K: A == k ? jump jt : jump jf
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K: A & k ? jt : jf
_RET_K = 0x06  # BPF_RET | BPF_K
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000  # | errno in the low 16 bits
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0_LOW = 0, 4, 16  # struct seccomp_data, little-endian
_X32_SYSCALL_BIT = 0x40000000
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWTIME
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80

# machine (platform.machine()) -> (AUDIT_ARCH_* of its native ABI, index of its number in SYSCALLS)
ARCHITECTURES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}

# name -> (x86_64 number, aarch64 number or None where the call does not exist there); from asm/unistd_64.h and
# asm-generic/unistd.h
SYSCALLS: dict[str, tuple[int, int | None]] = {
    "clone": (56, 220),
    "clone3": (435, 435),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "unshare": (272, 97),
    "setns": (308, 268),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "move_mount": (429, 429),
    "open_tree": (428, 428),
    "mount_setattr": (442, 442),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438),
    "kcmp": (312, 272),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "syslog": (103, 116),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "vhangup": (153, 58),
    "lookup_dcookie": (212, 18),
    "fanotify_init": (300, 262),
    "personality": (135, 92),
    "uselib": (134, None),
    "iopl": (172, None),
    "ioperm": (173, None),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "adjtimex": (159, 171),
    "clock_adjtime": (305, 266),
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "setpriority": (141, 140),
    "sched_setscheduler": (144, 119),
    "sched_setparam": (142, 118),
    "sched_setattr": (314, 274),
    "memfd_create": (319, 279),
    "memfd_secret": (447, 447),
    "shmget": (29, 194),
}
REFUSED = [name for name in SYSCALLS if name not in ("clone", "clone3")]
"""Refused outright with EPERM."""


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def build_filter(machine: str | None = None) -> bytes:
    """The program for `machine` (default: this one's), as the bytes bubblewrap reads. KeyError naming the machine
    where there is no table for it."""
    machine = machine or platform.machine()
    if machine not in ARCHITECTURES:
        raise KeyError(f"no seccomp table for {machine!r} (known: {', '.join(ARCHITECTURES)})")
    arch, column = ARCHITECTURES[machine]
    refused = sorted({SYSCALLS[name][column] for name in REFUSED} - {None})
    clone, clone3 = SYSCALLS["clone"][column], SYSCALLS["clone3"][column]
    # layout: [arch check] [x32 check] [one test per refused number] [clone3] [clone] ALLOW | clone flags | EPERM
    tests = len(refused)
    deny = 2 + 2 + tests + 1 + 1 + 1 + 2 + 1  # index of the EPERM return
    enosys = deny + 1
    program = [_op(_LD_W_ABS, _OFFSET_ARCH)]
    program.append(_op(_JEQ_K, arch, jt=0, jf=deny - 2))  # another ABI: refused whole
    program.append(_op(_LD_W_ABS, _OFFSET_NR))
    program.append(_op(_JGE_K, _X32_SYSCALL_BIT, jt=deny - 4, jf=0))  # x32 numbers on x86_64
    for i, number in enumerate(refused):
        program.append(_op(_JEQ_K, number, jt=deny - (4 + i) - 1, jf=0))
    here = 4 + tests
    program.append(_op(_JEQ_K, clone3, jt=enosys - here - 1, jf=0))
    program.append(_op(_JEQ_K, clone, jt=1, jf=0))
    program.append(_op(_RET_K, RET_ALLOW))
    program.append(_op(_LD_W_ABS, _OFFSET_ARG0_LOW))  # clone's flags: its first argument, low 32 bits
    program.append(_op(_JSET_K, CLONE_NAMESPACE_FLAGS, jt=1, jf=0))
    program.append(_op(_RET_K, RET_ALLOW))
    assert len(program) == deny, (len(program), deny)
    program.append(_op(_RET_K, RET_ERRNO | errno.EPERM))
    program.append(_op(_RET_K, RET_ERRNO | errno.ENOSYS))
    return b"".join(program)


def run_filter(program: bytes, arch: int, nr: int, arg0: int = 0) -> int:
    """Interpret `program` on one system call (what the kernel would return): for the tests."""
    ops = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    data = {_OFFSET_NR: nr, _OFFSET_ARCH: arch, _OFFSET_ARG0_LOW: arg0 & 0xFFFFFFFF}
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = ops[pc]
        if code == _LD_W_ABS:
            accumulator, pc = data[k], pc + 1
        elif code == _RET_K:
            return k
        else:
            taken = {_JEQ_K: accumulator == k, _JGE_K: accumulator >= k, _JSET_K: bool(accumulator & k)}[code]
            pc += 1 + (jt if taken else jf)
