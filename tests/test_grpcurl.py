"""Each service as a real process, driven with nothing but the real grpcurl binary."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import one_flyd
from tests.harness import ServiceProcess, clean_env, grpcurl


@pytest.fixture(scope="module")
def flyd(tmp_path_factory: pytest.TempPathFactory, image_source: Path) -> Iterator[str]:
    with one_flyd(tmp_path_factory.mktemp("grpcurl"), image_source, "23050-23099") as proc:
        yield proc.address
        assert proc.terminate() == 0  # graceful shutdown exits 0


@pytest.fixture(scope="module")
def flaps(flyd: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("grpcurl-flaps")
    proc = ServiceProcess(
        "flaps",
        ["--listen", "127.0.0.1:0", "--workers", flyd],
        tmp / "flaps.log",
        env=clean_env(),
    ).start()
    yield proc.address
    assert proc.terminate() == 0


@pytest.fixture(scope="module")
def proxy(flyd: str, flaps: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("grpcurl-proxy")
    proc = ServiceProcess(
        "proxy",
        [
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--flaps",
            flaps,
            "--workers",
            flyd,
        ],
        tmp / "proxy.log",
        env=clean_env(),
    ).start()
    yield proc.address
    assert proc.terminate() == 0


def ok(*args: str) -> str:
    result = grpcurl(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_list_shows_the_service_health_and_reflection(flyd: str, flaps: str) -> None:
    common = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert common | {"flyd.v1.WorkerService"} <= set(ok("-plaintext", flyd, "list").split())
    assert common | {
        "flaps.v1.MachinesService",
        "flaps.v1.PlatformService",
        "registry.v1.RegistryService",
    } <= set(ok("-plaintext", flaps, "list").split())
    for service in ("flaps.v1.MachinesService", "flaps.v1.PlatformService"):
        health = json.loads(
            ok(
                "-plaintext",
                "-d",
                json.dumps({"service": service}),
                flaps,
                "grpc.health.v1.Health/Check",
            )
        )
        assert health == {"status": "SERVING"}
    assert "rpc CreateMachine" in ok("-plaintext", flaps, "describe", "flaps.v1.MachinesService")


def test_describe_and_health(flyd: str) -> None:
    described = ok("-plaintext", flyd, "describe", "flyd.v1.WorkerService")
    for rpc in ("CreateMachine", "WatchEvents", "GetMachineLogs", "CordonWorker"):
        assert f"rpc {rpc}" in described
    assert "message CreateMachineRequest" in ok(
        "-plaintext", flyd, "describe", "flyd.v1.CreateMachineRequest"
    )
    for service in ("", "flyd.v1.WorkerService"):
        health = json.loads(
            ok(
                "-plaintext",
                "-d",
                json.dumps({"service": service}),
                flyd,
                "grpc.health.v1.Health/Check",
            )
        )
        assert health == {"status": "SERVING"}


def test_a_machine_lifecycle_with_json_bodies_alone(flyd: str) -> None:
    body = {
        "app": "demo",
        "config": {
            "image": "demo:v1",
            "guest": {"cpu_millicores": 100, "memory_mib": 64},
            "entrypoint": ["sleep"],
            "cmd": ["1000"],
        },
    }
    created = json.loads(
        ok("-plaintext", "-d", json.dumps(body), flyd, "flyd.v1.WorkerService/CreateMachine")
    )["machine"]
    mid = created["id"]
    waited = json.loads(
        ok(
            "-plaintext",
            "-d",
            json.dumps({"machine_id": mid, "state": "MACHINE_STATE_STARTED", "timeout": "20s"}),
            flyd,
            "flyd.v1.WorkerService/WaitMachine",
        )
    )["machine"]
    assert waited["state"] == "MACHINE_STATE_STARTED"
    got = json.loads(
        ok(
            "-plaintext",
            "-d",
            json.dumps({"machine_id": mid}),
            flyd,
            "flyd.v1.WorkerService/GetMachine",
        )
    )["machine"]
    assert got["app"] == "demo"
    assert got["region"] == "ams"
    assert got["worker_id"] == "w1"
    destroyed = json.loads(
        ok(
            "-plaintext",
            "-d",
            json.dumps({"machine_id": mid, "force": True}),
            flyd,
            "flyd.v1.WorkerService/DestroyMachine",
        )
    )["machine"]
    assert destroyed["state"] in ("MACHINE_STATE_DESTROYING", "MACHINE_STATE_DESTROYED")
    ok(
        "-plaintext",
        "-d",
        json.dumps({"machine_id": mid, "state": "MACHINE_STATE_DESTROYED", "timeout": "20s"}),
        flyd,
        "flyd.v1.WorkerService/WaitMachine",
    )


def test_bad_input_through_grpcurl_names_the_field(flyd: str) -> None:
    body = {
        "app": "demo",
        "config": {"image": "demo:v1", "guest": {"cpu_millicores": 100, "memory_mib": -5}},
    }
    result = grpcurl(
        "-plaintext", "-d", json.dumps(body), flyd, "flyd.v1.WorkerService/CreateMachine"
    )
    assert result.returncode != 0
    assert "InvalidArgument" in result.stderr
    assert "config.guest.memory_mib" in result.stderr


def test_a_machine_lifecycle_through_flaps_with_grpcurl_alone(flaps: str) -> None:
    def call(rpc: str, body: dict[str, object]) -> dict[str, object]:
        return dict(json.loads(ok("-plaintext", "-d", json.dumps(body), flaps, rpc)))

    def workers_alive() -> bool:
        listed = call("flaps.v1.PlatformService/ListWorkers", {})
        return [w["status"] for w in listed.get("workers", [])] == ["WORKER_STATUS_ALIVE"]

    deadline = time.monotonic() + 30
    while not workers_alive():
        assert time.monotonic() < deadline, "flaps never saw its worker"
        time.sleep(0.05)
    body = {
        "app": "demo",
        "region": "ams",
        "config": {
            "image": "demo:v1",
            "guest": {"cpu_millicores": 100, "memory_mib": 64},
            "entrypoint": ["sleep"],
            "cmd": ["1000"],
        },
    }
    machine = call("flaps.v1.MachinesService/CreateMachine", body)["machine"]
    assert isinstance(machine, dict)
    mid = machine["id"]
    waited = call(
        "flaps.v1.MachinesService/WaitMachine",
        {"machine_id": mid, "state": "MACHINE_STATE_STARTED", "timeout": "20s"},
    )
    assert waited["machine"]["state"] == "MACHINE_STATE_STARTED"  # type: ignore[index]
    got = call("flaps.v1.MachinesService/GetMachine", {"machine_id": mid})
    assert got["machine"]["worker_id"] == "w1"  # type: ignore[index]
    call("flaps.v1.MachinesService/DestroyMachine", {"machine_id": mid, "force": True})
    call(
        "flaps.v1.MachinesService/WaitMachine",
        {"machine_id": mid, "state": "MACHINE_STATE_DESTROYED", "timeout": "20s"},
    )


def test_the_proxy_serves_its_admin_api_health_and_reflection(proxy: str) -> None:
    services = set(ok("-plaintext", proxy, "list").split())
    assert {
        "proxy.v1.ProxyService",
        "registry.v1.RegistryService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services
    assert "rpc DrainWorker" in ok("-plaintext", proxy, "describe", "proxy.v1.ProxyService")
    health = json.loads(
        ok(
            "-plaintext",
            "-d",
            json.dumps({"service": "proxy.v1.ProxyService"}),
            proxy,
            "grpc.health.v1.Health/Check",
        )
    )
    assert health == {"status": "SERVING"}
    stats = json.loads(ok("-plaintext", "-d", "{}", proxy, "proxy.v1.ProxyService/GetStats"))
    assert "latency" in stats
    refused = grpcurl(
        "-plaintext",
        "-d",
        json.dumps({"worker_id": "nosuch"}),
        proxy,
        "proxy.v1.ProxyService/DrainWorker",
    )
    assert refused.returncode != 0
    assert "NotFound" in refused.stderr
