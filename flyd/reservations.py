"""What this worker's machines reserve, and whether one more fits.

Running totals (cpu, memory, disk, machine slots, machines by state) kept in step with every
row the runner commits, so placement checks, heartbeats and metric scrapes cost O(1); the
creates under way, reserved before their first commit; and the host ports handed to machine
services (held by the driver from the moment they are handed out). `check_room` and the port
allocators raise ResourceExhausted naming the resource.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from flyd import fsm
from flyd.images.cache import CachedImage
from flyd.settings import CapacitySettings
from flyd.v1 import machine_pb2 as pb
from model.errors import ResourceExhausted
from model.validate import guest_disk_mib

S = pb.MachineState


@dataclass(slots=True)
class Totals:
    """Resources reserved by a set of machines, kept as running sums."""

    cpu_millicores: int = 0
    memory_mib: int = 0
    disk_mib: int = 0
    machines: int = 0

    def add(self, guest: pb.GuestConfig, sign: int = 1) -> None:
        self.cpu_millicores += sign * guest.cpu_millicores
        self.memory_mib += sign * guest.memory_mib
        self.disk_mib += sign * guest_disk_mib(guest)  # what its filesystem is made at
        self.machines += sign


class Reservations:
    """The worker's resources: what it offers, what its rows and pending creates reserve."""

    def __init__(
        self,
        *,
        worker_id: str,
        total: CapacitySettings,
        rows: Mapping[str, fsm.Row],
        ports: range,
        machine_host: str,
        hold_ports: Callable[[str, Iterable[int], int], list[int]],
    ) -> None:
        """`rows`: the worker's rows, read (never changed) to find the host ports in use.
        `hold_ports(machine_id, candidates, count)`: the driver's, which binds and keeps them.
        """
        self.worker_id = worker_id
        self.total = total
        self.ports = ports
        self.machine_host = machine_host
        self._rows = rows
        self._hold_ports = hold_ports
        self._used = Totals()
        self._by_state: collections.Counter[int] = collections.Counter()
        # Machines being created: reserved (and their ports taken) before their first commit.
        self.pending: dict[str, pb.Machine] = {}
        # (app, idempotency key) -> the machine it created (or is creating): one key, one
        # machine. Durable as the rows are: rebuilt from them, forgotten with a dropped row.
        self.keys: dict[tuple[str, str], str] = {}

    def account(self, old: fsm.Row | None, new: fsm.Row | None) -> None:
        """Keep the running totals (reservations, machines by state) and the keys held in
        step with the rows."""
        for row, sign in ((old, -1), (new, 1)):
            if row is None:
                continue
            self._by_state[row.state] += sign
            if row.state != S.MACHINE_STATE_DESTROYED:
                self._used.add(row.machine.config.guest, sign)
            if row.machine.idempotency_key:
                key = (row.machine.app, row.machine.idempotency_key)
                if sign > 0:
                    self.keys[key] = row.machine.id
                elif self.keys.get(key) == row.machine.id:
                    del self.keys[key]

    def reserved(self) -> pb.Resources:
        """What the machines that are not destroyed reserve, plus creates under way."""
        used = self._used
        res = pb.Resources(
            cpu_millicores=used.cpu_millicores,
            memory_mib=used.memory_mib,
            disk_mib=used.disk_mib,
            machines=used.machines,
        )
        for machine in self.pending.values():
            guest = machine.config.guest
            res.cpu_millicores += guest.cpu_millicores
            res.memory_mib += guest.memory_mib
            res.disk_mib += guest_disk_mib(guest)
            res.machines += 1
        return res

    def machines_by_state(self) -> dict[int, int]:
        """How many machines (rows, destroyed ones included while kept) are in each state."""
        return {state: n for state, n in self._by_state.items() if n}

    def capacity(self, *, cordoned: bool, images: Iterable[CachedImage]) -> pb.Capacity:
        """The worker's capacity as heartbeats and GetCapacity report it."""
        total = pb.Resources(
            cpu_millicores=self.total.cpu_millicores,
            memory_mib=self.total.memory_mib,
            disk_mib=self.total.disk_mib,
            machines=self.total.machines,
        )
        used = self.reserved()
        free = pb.Resources(
            cpu_millicores=total.cpu_millicores - used.cpu_millicores,
            memory_mib=total.memory_mib - used.memory_mib,
            disk_mib=total.disk_mib - used.disk_mib,
            machines=total.machines - used.machines,
        )
        cap = pb.Capacity(total=total, free=free, cordoned=cordoned)
        for state, count in self.machines_by_state().items():
            cap.machines_by_state[fsm.state_name(state)] = count
        for img in images:
            cached = cap.images.add(ref=img.ref, digest=img.digest, size_bytes=img.size_bytes)
            cached.last_used.FromNanoseconds(int(img.last_used * 1e9))
        return cap

    def check_room(self, guest: pb.GuestConfig, instead_of: pb.GuestConfig | None = None) -> None:
        """Raise ResourceExhausted unless `guest` fits (replacing `instead_of`, for an update)."""
        used = self.reserved()
        if instead_of is not None:
            used.cpu_millicores -= instead_of.cpu_millicores
            used.memory_mib -= instead_of.memory_mib
            used.disk_mib -= guest_disk_mib(instead_of)
            used.machines -= 1
        wants = [
            (
                "cpu",
                guest.cpu_millicores,
                self.total.cpu_millicores - used.cpu_millicores,
                "millicores",
            ),
            ("memory", guest.memory_mib, self.total.memory_mib - used.memory_mib, "MiB"),
            ("disk", guest_disk_mib(guest), self.total.disk_mib - used.disk_mib, "MiB"),
            ("machines", 1, self.total.machines - used.machines, "machines"),
        ]
        for resource, need, free, unit in wants:
            if need > free:
                raise ResourceExhausted(
                    resource,
                    f"worker {self.worker_id} has {free} {unit} of {resource} free; "
                    f"the machine needs {need}",
                )

    def allocate_ports(self, machine_id: str, count: int) -> list[int]:
        """`count` host ports no machine has, bound and held for `machine_id` by the driver
        (a port is free when binding it works, and from then on it is the machine's).
        """
        if count == 0:
            return []
        used = {
            p.host_port
            for row in self._rows.values()
            if row.state != S.MACHINE_STATE_DESTROYED
            for p in row.machine.ports
        }
        used.update(p.host_port for m in self.pending.values() for p in m.ports)
        try:
            return self._hold_ports(machine_id, (p for p in self.ports if p not in used), count)
        except ResourceExhausted:
            raise ResourceExhausted(
                "ports",
                f"worker {self.worker_id} has no free host port in "
                f"{self.ports.start}-{self.ports.stop - 1}",
            ) from None

    def remap_ports(self, row: fsm.Row, config: pb.MachineConfig) -> list[pb.PortMapping]:
        """Keep the host port of every service port that stays; map the new ones."""
        kept = {p.internal_port: p for p in row.machine.ports}
        new = [svc.internal_port for svc in config.services if svc.internal_port not in kept]
        fresh = iter(self.allocate_ports(row.machine.id, len(new)))
        out = []
        for svc in config.services:
            mapping = kept.get(svc.internal_port)
            if mapping is None:
                mapping = pb.PortMapping(
                    internal_port=svc.internal_port, host=self.machine_host, host_port=next(fresh)
                )
            out.append(mapping)
        return out
