"""The `/bin/sh` wrappers machines run under, and their records.

The process driver's wrapper joins the machine's cgroups, `cd`s to the workdir, waits on the
hold pipe until flyd releases it, runs the machine's argv in the foreground and, when it exits,
writes the exit status to `status/exit` (through a rename where it can) before exiting with the
same status. It traps the usual stop signals, only noting which arrived, so a signal sent to the
process group reaches the machine while the wrapper survives to record the status. The OCI
driver's wrapper (`oci_wrapper_script`) mounts the machine's rootfs in its own mount namespace
and runs `crun run` in the foreground instead, recording crun's status the same way. No Python
process per machine: a wrapper costs a few hundred KiB of RSS.

This module writes the script and reads exit records (the wrapper's, or the one the driver
writes when the wrapper could not) and the wrapper's own wait status back as `ExitStatus`es.
"""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path

from flyd.drivers.base import ExitStatus

__all__ = [
    "FORWARDED_SIGNALS",
    "SETUP_FAILED_EXIT_CODE",
    "WRAPPER_PREFIX",
    "exit_record",
    "from_wait_status",
    "from_waitid",
    "oci_wrapper_script",
    "read_exit_file",
    "wrapper_script",
]

# Signals a stop or a signal request commonly uses: the wrapper survives them (see module doc).
FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# Exit code of the wrapper when it could not set the machine up (join cgroups, cd): like
# `docker run`'s 125, distinct from the shell's 126 (not executable) and 127 (not found).
SETUP_FAILED_EXIT_CODE = 125
# Names the wrapper uses (its function and its variable): reserved in machine environments.
WRAPPER_PREFIX = "__nonomad_"
_WRAPPER_VAR = "__nonomad_signal"
# What the exit file holds when the wrapper ended without being released.
_HELD = "held"


def wrapper_script(
    status_dir: Path, cwd: Path, env: dict[str, str], cgroup_procs: list[Path], mv: str
) -> str:
    """The sh program every machine runs under; the machine's argv follows as "$@".

    Traps do not use '': ignored dispositions would be inherited by the machine. The machine
    runs in the foreground (in a non-interactive sh, `&` would make it ignore SIGINT and
    SIGQUIT). A trapped signal arriving meanwhile reaches the machine through the process
    group; the trap runs only after the machine exits, and `$?` is then the machine's own
    status (128+signo if a signal killed it). A signal that arrives before the machine is
    started ends the wrapper as if it had killed the machine, so a stop right after a start is
    not lost. Its one variable is unset first, so it is never exported to the machine.
    """
    q = shlex.quote
    lines = _prelude(status_dir, cgroup_procs, mv)
    lines.append(f"cd {q(str(cwd))} || __nonomad_exit {SETUP_FAILED_EXIT_CODE}")
    # `cd` exported these; the machine gets exactly the environment flyd passed.
    lines += [f"unset {name}" for name in ("PWD", "OLDPWD") if name not in env]
    # Held until flyd has recorded the handle: EOF (flyd died first) means never run, and the
    # exit file says so ("held"), so a later flyd knows this process ran nothing.
    lines += [
        f"IFS= read -r {WRAPPER_PREFIX}go || {{ __nonomad_record {_HELD}; "
        f"exit {SETUP_FAILED_EXIT_CODE}; }}",
        f"unset {WRAPPER_PREFIX}go",
        "exec </dev/null",
    ]
    lines += [
        f'[ -z "${{{_WRAPPER_VAR}-}}" ] || __nonomad_exit $((128 + {_WRAPPER_VAR}))',
        'command "$@"',  # `command`: never our function, whatever argv[0] is
        "__nonomad_exit $?",
    ]
    return "\n".join(lines) + "\n"


def _prelude(status_dir: Path, cgroup_procs: list[Path], mv: str) -> list[str]:
    """Both wrappers' start: traps that only note a signal, the record and exit functions,
    and joining the machine's cgroups.
    """
    q = shlex.quote
    tmp, final = q(str(status_dir / "exit.tmp")), q(str(status_dir / "exit"))
    lines = [f"unset {_WRAPPER_VAR}"]
    lines += [
        f"trap '{_WRAPPER_VAR}={int(s)}' {s.name.removeprefix('SIG')}" for s in FORWARDED_SIGNALS
    ]
    lines += [
        "__nonomad_record() {",
        f"  {{ printf '%s\\n' \"$1\" > {tmp} && {q(mv)} -f {tmp} {final}; }} ||",
        f"    printf '%s\\n' \"$1\" > {final}",
        "}",
        "__nonomad_exit() {",
        '  __nonomad_record "$1"',
        '  exit "$1"',
        "}",
    ]
    lines += [
        f"echo $$ > {q(str(p))} || __nonomad_exit {SETUP_FAILED_EXIT_CODE}" for p in cgroup_procs
    ]
    return lines


def oci_wrapper_script(
    status_dir: Path,
    mv: str,
    *,
    mounts: list[list[str]],
    crun: list[str],
    held_marker: Path,
) -> str:
    """The sh program an OCI machine runs under, in a mount namespace of its own.

    It runs `mounts` (each an argv: unmounting what crun cannot
    live with, binding the run dir where crun can reach it, mounting the machine's overlay),
    runs `crun` in the foreground and records its status (crun passes the container's: a
    code, or 128+signo). When the hold hook left `held_marker` the container never ran: it
    records `held`. It keeps the descriptors flyd passed it (the overlay's lower layer, the
    hold hook's pipes) open for its whole life.
    """
    q = shlex.quote
    lines = _prelude(status_dir, [], mv)  # the container joins the machine's cgroups itself
    lines += [
        f"{' '.join(q(a) for a in argv)} || __nonomad_exit {SETUP_FAILED_EXIT_CODE}"
        for argv in mounts
    ]
    lines += [
        f"{' '.join(q(a) for a in crun)} </dev/null",
        "__nonomad_code=$?",
        f"if [ -e {q(str(held_marker))} ]; then",
        f"  rm -f {q(str(held_marker))}; __nonomad_record {_HELD}; exit {SETUP_FAILED_EXIT_CODE}",
        "fi",
        '__nonomad_exit "$__nonomad_code"',
    ]
    return "\n".join(lines) + "\n"


def read_exit_file(path: Path) -> ExitStatus | None:
    """The status an exit record holds; None if there is none or it is unreadable."""
    try:
        # O_NOFOLLOW: the status dir is writable by the machine's user.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            text = f.read(32).strip()
        if text == _HELD.encode():
            return ExitStatus(exit_code=SETUP_FAILED_EXIT_CODE, signal=None, released=False)
        return _from_shell_status(int(text))
    except (OSError, ValueError):
        return None


def exit_record(status: ExitStatus) -> bytes:
    """What `read_exit_file` reads back as `status` (a signal death as 128+signo, like sh)."""
    code = status.exit_code if status.signal is None else 128 + status.signal
    return f"{code}\n".encode()


def _from_shell_status(code: int) -> ExitStatus:
    # sh reports a death by signal N as 128+N; an explicit `exit 137` looks the same (as with
    # Docker), which is the price of a shell wrapper.
    if 128 < code <= 128 + signal.SIGRTMAX:
        return ExitStatus(exit_code=None, signal=code - 128)
    return ExitStatus(exit_code=code, signal=None)


def from_wait_status(returncode: int) -> ExitStatus:
    """From Popen's returncode: negative for a signal death (of the wrapper itself)."""
    if returncode < 0:
        return ExitStatus(exit_code=None, signal=-returncode)
    return _from_shell_status(returncode)


def from_waitid(result: os.waitid_result) -> ExitStatus:
    """From `os.waitid` on the wrapper: its exit code (sh-encoded) or the signal that killed it."""
    if result.si_code == os.CLD_EXITED:
        return _from_shell_status(result.si_status)
    return ExitStatus(exit_code=None, signal=result.si_status)
