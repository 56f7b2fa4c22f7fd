"""flaps' /metrics, scraped from a real flaps process in front of real workers.

Claims are refused deterministically by giving each ams worker a single host port: once a
machine with a service holds it, the worker refuses the next such machine ("ports"), which
flaps' view does not track, so flaps claims, is refused, and falls back.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flaps.v1 import machines_pb2 as m
from flaps.v1 import platform_pb2 as p
from flyd.v1 import machine_pb2 as pb
from tests.flaps.conftest import Fleet, eventually

T = 30  # RPC deadline, s


def one_port() -> str:
    """A port range of one port that is free now (from the kernel's ephemeral range)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"{port}-{port}"


def with_service(memory_mib: int = 64) -> pb.MachineConfig:
    return pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=memory_mib),
        entrypoint=["sleep"],
        cmd=["1000"],
        services=[pb.ServiceConfig(internal_port=8080)],
    )


async def scrape(address: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample at http://address/metrics, by (name, labels)."""

    def fetch() -> str:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            body: bytes = resp.read()
        return body.decode()

    text = await asyncio.to_thread(fetch)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_placements_rejections_claims_and_fallbacks_are_counted(fleet: Fleet) -> None:
    for worker_id in ("ams-1", "ams-2"):
        fleet.add_worker(worker_id, "ams", "--capacity.memory-mib", "512", ports=one_port())
    fleet.add_worker("syd-1", "syd")
    # Liveness must not flip under a loaded machine: a worker briefly suspect is rejected
    # without a claim, and the counts below are of claims.
    flaps = fleet.add_flaps(
        "--metrics-listen", "127.0.0.1:0", "--suspect-after", "30", "--dead-after", "60"
    )
    metrics = flaps.announced["NONOMAD_METRICS"]
    await fleet.until_alive()
    machines, platform = fleet.machines(), fleet.platform()

    async def create(**fields: object) -> pb.Machine:
        request = m.CreateMachineRequest(app="web", config=with_service(), skip_launch=True)
        for name, field_value in fields.items():
            if isinstance(field_value, list):
                getattr(request, name).extend(field_value)
            elif isinstance(field_value, pb.MachineConfig):
                request.config.CopyFrom(field_value)
            else:
                setattr(request, name, field_value)
        return (await machines.CreateMachine(request, timeout=T)).machine

    # 1. Placed at once: both ams workers have their port.
    first = await create(region="ams")
    full, other = first.worker_id, ({"ams-1", "ams-2"} - {first.worker_id}).pop()

    async def full_ranks_first() -> bool:
        sim = await platform.SimulatePlacement(
            p.SimulatePlacementRequest(app="web", region="ams", config=with_service()), timeout=T
        )
        ranked = [(c.worker_id, c.score) for c in sim.candidates]
        # Strictly ahead: equal scores keep a random order, and so would the create's ranking
        # (as they are while flaps' view has not yet seen the first machine).
        return [w for w, _ in ranked] == [full, other] and ranked[0][1] > ranked[1][1]

    await eventually(full_ranks_first, 15, f"flaps to rank {full} (fuller) first")
    # 2. The fuller worker is claimed first and refuses (no port): flaps falls back.
    second = await create(region="ams")
    assert second.worker_id == other
    # 3. Both refuse: nothing in ams can take it.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await create(region="ams")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 refused" in (err.value.details() or "")
    # 4. Both refuse again, and the named fallback region takes it.
    assert (await create(regions=["ams", "syd"])).region == "syd"
    # 5. Too big for any ams worker: placement rejects both without claiming.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await create(region="ams", config=with_service(memory_mib=600))
    assert "2 insufficient_memory" in (err.value.details() or "")

    got = await scrape(metrics)
    placements = {
        (region, outcome): value(
            got, "nonomad_flaps_placements_total", region=region, outcome=outcome
        )
        for region in ("ams", "syd")
        for outcome in ("placed", "exhausted", "failed")
    }
    assert placements == {
        ("ams", "placed"): 2,
        ("ams", "exhausted"): 3,
        ("ams", "failed"): 0,
        ("syd", "placed"): 1,
        ("syd", "exhausted"): 0,
        ("syd", "failed"): 0,
    }
    rejections = {
        dict(labels)["reason"]: n
        for (name, labels), n in got.items()
        if name == "nonomad_flaps_rejections_total"
    }
    assert rejections == {"refused": 5, "insufficient_memory": 2}, rejections
    assert value(got, "nonomad_flaps_claims_total", outcome="accepted") == 3
    assert value(got, "nonomad_flaps_claims_total", outcome="refused") == 5
    assert value(got, "nonomad_flaps_claims_total", outcome="unreachable") == 0
    assert value(got, "nonomad_flaps_fallbacks_total", to="next_worker") == 3
    assert value(got, "nonomad_flaps_fallbacks_total", to="next_region") == 1

    # The embedded registry replica reports through the same endpoint.
    assert value(got, "nonomad_registry_workers", region="ams", status="alive") == 2
    assert value(got, "nonomad_registry_workers", region="syd", status="alive") == 1
    assert value(got, "nonomad_registry_events_applied_total", kind="snapshot") >= 3
    assert value(got, "nonomad_registry_events_applied_total", kind="heartbeat") >= 3
    # Every machine created is a change the replica applied, with its lag measured.
    assert value(got, "nonomad_registry_events_applied_total", kind="change") >= 3
    assert value(got, "nonomad_registry_replication_lag_seconds_count") >= 3
    for worker_id in (full, other, "syd-1"):
        assert (
            "nonomad_registry_replication_lag_last_seconds",
            frozenset({("worker", worker_id)}),
        ) in got
