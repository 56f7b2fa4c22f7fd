"""The seccomp filter every OCI machine runs under.

crun applies whatever filter the bundle carries and has no profile of its own; this is the
usual container default (Docker's and Podman's), written as a deny list: every system call is
allowed except those that reach past the machine's namespaces to the kernel or the host
(modules, kexec, keyrings, reboot, clocks, swap, accounting, quotas, raw I/O ports, BPF,
perf, userfaultfd, io_uring, handles to arbitrary inodes, another process's memory) and
those that would let it build new namespaces or mounts. They fail with EPERM; `clone3`, whose
flags a filter cannot inspect, fails with ENOSYS so libc falls back to `clone`, where asking
for a new user namespace is refused by flag.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DENIED", "profile"]

DENIED = (
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "get_kernel_syms",
    "init_module",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "ioperm",
    "iopl",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "mount_setattr",
    "move_mount",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "process_vm_readv",
    "process_vm_writev",
    "query_module",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "settimeofday",
    "swapoff",
    "swapon",
    "syslog",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
    "ustat",
    "vhangup",
)

_EPERM = 1
_ENOSYS = 38
_CLONE_NEWUSER = 0x10000000


def profile() -> dict[str, Any]:
    """The `linux.seccomp` section of an OCI runtime spec."""
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_AARCH64"],
        "syscalls": [
            {"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": _EPERM},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS},
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": _EPERM,
                "args": [
                    {
                        "index": 0,
                        "value": _CLONE_NEWUSER,
                        "valueTwo": _CLONE_NEWUSER,
                        "op": "SCMP_CMP_MASKED_EQ",
                    }
                ],
            },
        ],
    }
