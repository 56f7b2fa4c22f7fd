"""What the tests of flaps as a real process share: the RPC deadline, a small machine config,
a fleet of ams and syd workers behind one flaps or more (tests/flaps/conftest.py's Fleet)."""

from __future__ import annotations

from typing import Any

from flyd.v1 import machine_pb2 as pb
from tests.flaps.conftest import Fleet

T = 30  # RPC deadline, s


def config(memory_mib: int = 64, **changes: Any) -> pb.MachineConfig:
    cfg = pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=memory_mib),
        entrypoint=["sleep"],
        cmd=["1000"],
    )
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


async def ams_and_syd(fleet: Fleet, flaps: int = 1) -> None:
    fleet.add_worker("ams-1", "ams", "--capacity.memory-mib", "512")
    fleet.add_worker("ams-2", "ams", "--capacity.memory-mib", "512")
    fleet.add_worker("syd-1", "syd", "--capacity.memory-mib", "512")
    for _ in range(flaps):
        fleet.add_flaps()
    for i in range(flaps):
        await fleet.until_alive(i)
