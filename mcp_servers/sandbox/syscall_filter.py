"""The seccomp filter every sandbox runs under (bubblewrap ``--seccomp FD``), built once at start.

Default: allow. Denied with ``EPERM``: new namespaces and joining others, mounts, tracing and reading
other processes, the kernel's keyring, eBPF, perf, userfaultfd, io_uring, module and kexec loading,
raw port IO, clock and system settings, ``personality``, and ``ioctl(TIOCSTI)`` (typing into a
terminal). ``clone`` is denied when it asks for any namespace flag; ``clone3`` answers ``ENOSYS``
(its flags sit in a struct a filter cannot read; glibc then falls back to ``clone``). Other
architectures (i386 via ``int 0x80``, x32) are killed by the filter libseccomp builds for the native
one. Untrusted Python needs none of these (threads, subprocesses, multiprocessing, asyncio and ssl
work).
"""

from __future__ import annotations

import errno
import tempfile

from fleet.errors import ErrorCode, FleetError

DENIED = (
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "name_to_handle_at",
    "lookup_dcookie",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "iopl",
    "ioperm",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "personality",
)
# CLONE_NEWUSER, NEWNS, NEWPID, NEWNET, NEWIPC, NEWUTS, NEWCGROUP, NEWTIME
NAMESPACE_FLAGS = (0x10000000, 0x00020000, 0x20000000, 0x40000000, 0x08000000, 0x04000000, 0x02000000, 0x80)
TIOCSTI = 0x5412


def build_filter() -> bytes:
    """The filter as a BPF program (what bubblewrap's ``--seccomp`` reads). Raises
    ``dependency_unavailable`` without pyseccomp or libseccomp, or if a syscall name is unknown to
    them: a filter that silently skipped a rule would be weaker than it claims."""
    try:
        import pyseccomp as sc  # type: ignore[import-untyped]
    except (ImportError, OSError) as exc:  # OSError: libseccomp.so.2 missing
        raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, f"no seccomp: {exc}") from exc
    program = sc.SyscallFilter(sc.ALLOW)
    for name in (*DENIED, "clone", "clone3", "ioctl"):
        if sc.resolve_syscall(sc.Arch.NATIVE, name) < 0:
            raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, f"seccomp does not know syscall {name}")
    for name in DENIED:
        program.add_rule(sc.ERRNO(errno.EPERM), name)
    for flag in NAMESPACE_FLAGS:
        program.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    program.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    program.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    with tempfile.TemporaryFile() as fh:
        program.export_bpf(fh)
        fh.seek(0)
        return fh.read()
