"""What only the process driver does: machines without cgroups, as another host user, and
their published ports, which it holds only while the machine is not running.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import tempfile
from pathlib import Path

import pytest
import structlog

from flyd.drivers.base import ExitStatus, PortMapping
from flyd.drivers.ports import bind_port
from flyd.drivers.process import ProcessDriver
from tests.flyd.driver_support import Exits, logged, run_machine, sh, spec


async def test_without_cgroups_machines_run_with_one_warning(run_root, image, tmp_path) -> None:
    exits = Exits()
    with structlog.testing.capture_logs() as logs:
        driver = ProcessDriver(run_root, on_exit=exits, cgroup_root=tmp_path / "no-cgroups")
    try:
        assert driver.limits_enforced is False
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert len(warnings) == 1
        assert warnings[0]["event"] == "cgroup_limits_not_enforced"
        assert "no cgroup v1 memory controller" in warnings[0]["reason"]
        await run_machine(driver, spec("m1", sh("exit 0"), image))
        assert await exits.wait("m1") == ExitStatus(0, None)
    finally:
        await driver.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="running machines as another user needs root")
async def test_run_as_unprivileged_user(prefix: str) -> None:
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user named nobody")
    base = Path(tempfile.mkdtemp(prefix="nonomad-test-"))  # pytest's tmp dirs are 0700
    os.chmod(base, 0o711)
    exits = Exits()
    driver = ProcessDriver(base / "run", on_exit=exits, cgroup_prefix=prefix, run_as="nobody")
    try:
        await run_machine(driver, spec("m1", sh("id -u; id -G"), base))
        status = await exits.wait("m1")
        logs = driver.read_logs("m1", 10)
        assert status == ExitStatus(0, None), logs  # 125: it could not join its cgroups
        assert logs == [str(nobody.pw_uid), str(nobody.pw_gid)]  # none of flyd's groups
    finally:
        await driver.close()
        shutil.rmtree(base)


def taken(port: int) -> bool:
    sock = bind_port("127.0.0.1", port)
    if sock is None:
        return True
    sock.close()
    return False


async def test_ports_are_held_while_the_machine_is_not_running(run_root, image, prefix) -> None:
    exits = Exits()
    driver = ProcessDriver(run_root, on_exit=exits, cgroup_prefix=prefix)
    try:
        (port,) = driver.hold_ports("m1", range(23000, 23100), 1)
        published = (PortMapping(port, 8080),)
        await driver.publish("m1", published)
        assert taken(port)  # a stopped standby's port: nobody else can have it
        serve = ["python3", "-c", SERVE]
        await run_machine(driver, spec("m1", serve, image, ports=published))
        await logged(driver, "m1", "serving")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            assert conn.recv(16) == b"hello"  # the machine bound its port itself
        await driver.stop("m1", signal.SIGTERM, timeout=5)
        assert taken(port)  # held again the moment it stopped
        await driver.cleanup("m1")
        assert not taken(port)  # destroyed: let go
    finally:
        await driver.close()


SERVE = """\
import os, socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(os.environ["PORT"])))
s.listen()
print("serving", flush=True)
while True:
    conn, _ = s.accept()
    conn.sendall(b"hello")
    conn.close()
"""
