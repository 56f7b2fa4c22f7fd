"""Workers and requests for the placement tests, written by hand: `worker(...)` as the registry
view would describe one, `supply_of` files them into a `registry.supply.Supply`, `request(...)`
asks for a machine in REGION."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from flaps.placement import Request
from flyd.v1 import machine_pb2 as pb
from registry.supply import Resources, Supply
from registry.view import ALIVE, DEAD, SUSPECT

REGION = "ord"
IMAGE = "registry.local/web:1"
STATUS = {"alive": ALIVE, "dead": DEAD, "suspect": SUSPECT}


@dataclass(frozen=True)
class Worker:
    """A worker as the registry view would describe it; `machines` maps machine id to app."""

    id: str
    region: str
    status: str
    cordoned: bool
    total: Resources
    free: Resources
    labels: dict[str, str]
    images: frozenset[str]
    machines: dict[str, str] = field(default_factory=dict)


def worker(
    id: str = "w1",
    *,
    region: str = REGION,
    status: str = "alive",
    cordoned: bool = False,
    cpu: int = 4000,
    memory: int = 8192,
    disk: int = 20480,
    slots: int = 16,
    used_cpu: int = 0,
    used_memory: int = 0,
    used_disk: int = 0,
    used_slots: int = 0,
    labels: dict[str, str] | None = None,
    images: Iterable[str] = (),
    machines: dict[str, str] | None = None,
) -> Worker:
    return Worker(
        id=id,
        region=region,
        status=status,
        cordoned=cordoned,
        total=Resources(cpu, memory, disk, slots),
        free=Resources(cpu - used_cpu, memory - used_memory, disk - used_disk, slots - used_slots),
        labels=dict(labels or {}),
        images=frozenset(images),
        machines=dict(machines or {}),
    )


def supply_of(workers: Iterable[Worker]) -> Supply:
    supply = Supply()
    for w in workers:
        supply.update(
            w.id,
            region=w.region,
            labels=w.labels,
            status=STATUS[w.status],
            cordoned=w.cordoned,
            total=w.total,
            free=w.free,
            images=w.images,
        )
        for app in w.machines.values():
            supply.count(w.id, app, 1)
    return supply


def request(
    *,
    app: str = "web",
    cpu: int = 1000,
    memory: int = 1024,
    disk: int = 0,
    image: str = IMAGE,
    labels: dict[str, str] | None = None,
    max_per_worker: int = 0,
    spread: bool = False,
    standby_for: dict[str, str] | None = None,
    seed: str | None = None,
) -> Request:
    """`standby_for` maps each primary to the worker that holds it."""
    primaries = standby_for or {}
    return Request(
        app=app,
        regions=(REGION,),
        guest=pb.GuestConfig(cpu_millicores=cpu, memory_mib=memory, disk_mib=disk),
        image=image,
        placement=pb.PlacementConfig(
            required_labels=labels or {}, max_per_worker=max_per_worker, spread=spread
        ),
        standby_for=frozenset(primaries),
        seed=seed,
        primaries={owner: primary for primary, owner in primaries.items()},
    )
