"""Each service as a real process, driven with nothing but the real grpcurl binary."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from flaps.v1 import machines_pb2, platform_pb2
from flyd.v1 import worker_pb2
from proxy.v1 import proxy_pb2
from registry.v1 import registry_pb2
from tests.conftest import one_flyd
from tests.harness import ServiceProcess, clean_env, grpcurl


@pytest.fixture(scope="module")
def flyd(tmp_path_factory: pytest.TempPathFactory, image_source: Path) -> Iterator[str]:
    with one_flyd(tmp_path_factory.mktemp("grpcurl"), image_source) as proc:
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
def registry(flyd: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("grpcurl-registry")
    proc = ServiceProcess(
        "registry",
        ["--listen", "127.0.0.1:0", "--workers", flyd],
        tmp / "registry.log",
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


# What each process serves: its own services, plus health and reflection for grpcurl.
SERVES: dict[str, list[ServiceDescriptor]] = {
    "flyd": [worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]],
    "flaps": [
        machines_pb2.DESCRIPTOR.services_by_name["MachinesService"],
        platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
    ],
    "proxy": [
        proxy_pb2.DESCRIPTOR.services_by_name["ProxyService"],
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
    ],
    "registry": [registry_pb2.DESCRIPTOR.services_by_name["RegistryService"]],
}
COMMON: list[ServiceDescriptor] = [
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
]


@pytest.fixture(scope="module")
def addresses(flyd: str, flaps: str, proxy: str, registry: str) -> dict[str, str]:
    return {"flyd": flyd, "flaps": flaps, "proxy": proxy, "registry": registry}


@pytest.mark.parametrize("process", sorted(SERVES))
def test_list_and_describe_every_service(addresses: dict[str, str], process: str) -> None:
    address = addresses[process]
    services = SERVES[process] + COMMON
    assert set(ok("-plaintext", address, "list").split()) == {s.full_name for s in services}
    for service in services:
        described = ok("-plaintext", address, "describe", service.full_name)
        assert described.startswith(f"{service.full_name} is a service:"), described
        for method in service.methods:
            assert f"rpc {method.name} (" in described, (service.full_name, method.name)
            # Enough to write a JSON body by hand: every request message is described too.
            request = method.input_type.full_name
            assert f"{request} is a message:" in ok("-plaintext", address, "describe", request)


@pytest.mark.parametrize("process", sorted(SERVES))
def test_every_service_reports_serving(addresses: dict[str, str], process: str) -> None:
    for name in ["", *(s.full_name for s in SERVES[process])]:
        health = json.loads(
            ok(
                "-plaintext",
                "-d",
                json.dumps({"service": name}),
                addresses[process],
                "grpc.health.v1.Health/Check",
            )
        )
        assert health == {"status": "SERVING"}, name


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


def test_the_proxy_admin_api_answers_json(proxy: str) -> None:
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
