"""The contract between flyd and a driver: what a machine's process is asked to be (a spec
with its limits), how flyd names it across restarts (a handle), how it ended (an exit status),
and the `Driver` protocol the worker is written against.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from model.errors import CorruptLog
from model.validate import DEFAULT_DISK_MIB

__all__ = [
    "DEFAULT_PIDS",
    "Driver",
    "ExitStatus",
    "Handle",
    "Limits",
    "LogTail",
    "PortMapping",
    "ProcessSpec",
    "port_env",
]

DEFAULT_PIDS = 1024
"""A machine's pids limit when its config sets none (`GuestConfig.pids_max` 0)."""


@dataclass(frozen=True)
class Limits:
    """Resources reserved for a machine: cpu, memory and pids enforced with cgroups when
    `limits_enforced`; `disk_mib` (what its writable layer holds) where `disk_limited`."""

    cpu_millicores: int
    memory_mib: int
    pids: int = DEFAULT_PIDS
    disk_mib: int = DEFAULT_DISK_MIB


@dataclass(frozen=True)
class PortMapping:
    """A published service: the host port (on 127.0.0.1) and the machine's own port."""

    host_port: int
    internal_port: int


@dataclass(frozen=True)
class ProcessSpec:
    """What to run for a machine.

    `argv` is already resolved (entrypoint + cmd, or the override). `rootfs` is the image's
    unpacked root (shared by every machine of the image: never written through), `workdir`
    and `user` come from the image config (`user`: "", a name, "uid" or "uid:gid"). `ports`
    are the machine's published services; each driver tells the machine its port in `PORT`
    and `PORT_<internal port>` (see `port_env`). `host_runtime`: the image names no base
    (a directory built by `nonomad image build`), so a sandboxing driver lends it the host's
    runtime directories read-only. `egress`: its config asks to reach beyond its worker
    (`network.egress`), which a driver that confines the network grants only through the
    worker's uplink.
    """

    machine_id: str
    argv: list[str]
    rootfs: Path
    env: dict[str, str]
    limits: Limits
    workdir: str = "/"
    user: str = ""
    ports: tuple[PortMapping, ...] = ()
    host_runtime: bool = False
    egress: bool = False


def port_env(ports: tuple[PortMapping, ...], *, inside: bool) -> dict[str, str]:
    """`PORT` (the first service) and `PORT_<internal port>` for each: the port the machine
    listens on, which is the host port when it shares the host's network (`inside=False`)
    and its own port when it has a network namespace of its own.
    """
    env: dict[str, str] = {}
    for i, p in enumerate(ports):
        port = str(p.internal_port if inside else p.host_port)
        if i == 0:
            env["PORT"] = port
        env[f"PORT_{p.internal_port}"] = port
    return env


@dataclass(frozen=True)
class Handle:
    """Identifies a machine's wrapper process across flyd restarts; flyd stores it in its log.

    A pid alone is not an identity: pids are recycled. The start time (in clock ticks since
    boot, field 22 of /proc/<pid>/stat) and the boot id pin down one process.
    """

    pid: int
    start_time: int
    boot_id: str

    def to_dict(self) -> dict[str, int | str]:
        """The JSON-ready form `from_dict` reads back."""
        return {"pid": self.pid, "start_time": self.start_time, "boot_id": self.boot_id}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Handle:
        """Reads `to_dict`'s form; anything else is a `CorruptLog`, never a guess."""
        pid, start_time, boot_id = data.get("pid"), data.get("start_time"), data.get("boot_id")
        if (
            not isinstance(pid, int)
            or not isinstance(start_time, int)
            or not isinstance(boot_id, str)
            or pid <= 0
        ):
            raise CorruptLog(f"not a process handle: {data!r}")
        return cls(pid=pid, start_time=start_time, boot_id=boot_id)


@dataclass(frozen=True)
class ExitStatus:
    """How a machine's process ended: exactly one of `exit_code` and `signal` is set."""

    exit_code: int | None
    signal: int | None
    oom_killed: bool = False
    # False: the process was held and never released, so it ran nothing of the machine's.
    released: bool = True

    def __post_init__(self) -> None:
        if (self.exit_code is None) == (self.signal is None):
            raise ValueError("exactly one of exit_code and signal must be set")

    def describe(self) -> str:
        """A phrase for humans: "exited with code 3", "killed by SIGKILL (out of memory)"."""
        if not self.released:
            return "ended before it was released"
        if self.exit_code is not None:
            text = f"exited with code {self.exit_code}"
        else:
            assert self.signal is not None
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            text = f"killed by {name}"
        return text + " (out of memory)" if self.oom_killed else text


@dataclass(frozen=True)
class LogTail:
    """The last lines of a machine's output, oldest first.

    `truncated_bytes`: how many bytes of the log come before the first line and were not read
    because the read's byte budget ran out (0: the tail is all that was asked, or all there is).
    `follow_from`: where in the current log the read ended, for a follow that goes on from the
    tail without missing what is written meanwhile (None: from the log's end when it starts).
    """

    lines: list[str]
    truncated_bytes: int = 0
    follow_from: int | None = None


class Driver(Protocol):
    """What flyd needs from a driver: `oci.OciDriver`, `process.ProcessDriver`, or
    `flyd.fakes.FakeDriver`.
    """

    limits_enforced: bool
    disk_limited: bool
    """Whether a machine's writes are bounded by `Limits.disk_mib` (a filesystem of its own)."""
    name: str
    egress_refusal: str | None
    """Why a machine asking for egress (`network.egress`) cannot have it here, or None."""

    def hold_ports(self, machine_id: str, candidates: Iterable[int], count: int) -> list[int]: ...
    def machine_address(self, machine_id: str) -> str:
        """The started machine's own address, where other hosts reach its services (its
        worker routes machines: `flyd --route-machines`); "" when they reach its host ports."""
        ...

    async def publish(self, machine_id: str, ports: Sequence[PortMapping]) -> None: ...
    async def reconcile(self, machines: Mapping[str, Sequence[PortMapping]]) -> None: ...
    def leftovers(self) -> list[str]: ...
    async def start(self, spec: ProcessSpec) -> Handle: ...
    def release(self, machine_id: str) -> None: ...
    def discard(self, machine_id: str) -> None: ...
    def attach(self, machine_id: str, handle: Handle) -> bool: ...
    def is_running(self, machine_id: str) -> bool: ...
    async def signal(self, machine_id: str, sig: int) -> None: ...
    async def stop(self, machine_id: str, sig: int, timeout: float) -> ExitStatus: ...
    def last_exit(self, machine_id: str) -> ExitStatus | None: ...
    async def cleanup(self, machine_id: str) -> None: ...
    def rotate_logs(self) -> None:
        """Bound the machines' logs that nothing else bounds. Blocking: run it off the loop."""
        ...

    def read_logs(self, machine_id: str, tail_lines: int, max_bytes: int) -> LogTail:
        """The last `tail_lines` lines of the machine's output, reading at most `max_bytes`
        of it however large it is. Blocking: run it off the loop."""
        ...

    def follow_logs(
        self,
        machine_id: str,
        *,
        shutdown: asyncio.Event,
        poll_interval: float = 0.1,
        from_offset: int | None = None,
    ) -> AsyncIterator[str]: ...
    async def close(self) -> None: ...
