"""The `nonomad` CLI as a user runs it: a real local cluster serving the demo app."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from flyd.drivers.procfs import read_proc_stat
from nonomad.cli_local import cgroup_prefix, worker_memory_cgroup
from tests.cli_support import console_login, nonomad, stop_up, up_demo
from tests.harness import REPO_ROOT, VENV_BIN


def alive(pid: int) -> bool:
    """Whether pid runs: a zombie left to a non-reaping init does not. (Read as flyd reads it:
    a process that dies while its stat is read fails the read with ESRCH, not ENOENT.)"""
    stat = read_proc_stat(pid)
    return stat is not None and stat.state != "Z"


def through_proxy(address: str, host: str, served_by: str = "") -> str:
    """GET / through the proxy; its registry may need a moment to learn the machine (and,
    with `served_by`, until that machine answers)."""
    deadline = time.monotonic() + 30
    while True:
        request = urllib.request.Request(f"http://{address}/", headers={"Host": host})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                body = str(resp.read().decode())
                if served_by in body or time.monotonic() > deadline:
                    return body
        except urllib.error.HTTPError as err:
            if err.code not in (404, 503) or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def read_until(up: subprocess.Popen[str], text: str) -> str:
    """`up`'s output lines until one contains `text` (the line)."""
    assert up.stdout is not None
    seen = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        assert line, "".join(seen)
        seen.append(line)
        if text in line:
            return line
    raise AssertionError(f"`up` never said {text!r}: {''.join(seen)}")


def eventually_true(check: Callable[[], bool], deadline: float = 30.0) -> bool:
    end = time.monotonic() + deadline
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def test_up_serves_the_demo_app_and_down_leaves_nothing_behind(tmp_path: Path) -> None:
    state = tmp_path / "cluster"
    up, text = up_demo(state)
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+/", text)
        assert url, text
        with urllib.request.urlopen(url.group(0), timeout=10) as resp:
            assert "hello from machine" in resp.read().decode()
        # And through the edge, by app name.
        edge = re.search(r"-H 'Host: (demo\.[a-z.]+)' http://(127\.0\.0\.1:\d+)/", text)
        assert edge, text
        assert "hello from machine" in through_proxy(edge.group(2), edge.group(1))

        # The web console `up` started (on a free port) needs a login: `up` printed a one-time
        # URL for it (a code, not the token). Opened as from the terminal, it logs in; then
        # the console shows this cluster's workers and the demo's two machines, as its JSON
        # twin and as the page.
        console = re.search(r"^the web console: (http://127\.0\.0\.1:\d+/)$", text, re.M)
        assert console, text
        console_url = console.group(1)
        login = re.search(
            r"^  log in \(the link works once, for 5 minutes\): (http://\S+/login\?code=\S+)$",
            text,
            re.M,
        )
        assert login, text
        admin_token = (state / "admin.token").read_text().strip()
        assert admin_token not in text
        with urllib.request.urlopen(console_url, timeout=10) as resp:
            assert resp.url.startswith(f"{console_url}login?next=")  # no session: the login
        cookie = console_login(login.group(1))
        seen: list[object] = []

        def console_shows_the_cluster() -> bool:
            ask = urllib.request.Request(
                console_url, headers={"Accept": "application/json", "Cookie": cookie}
            )
            with urllib.request.urlopen(ask, timeout=10) as resp:
                assert resp.headers["Content-Type"] == "application/json"
                fleet = json.load(resp)
            seen.append(fleet)
            workers = {w["id"]: w["status"] for w in fleet["workers"]}
            machines = sum(w["machines"]["total"] for w in fleet["workers"])
            apps = [a["name"] for a in fleet["apps"]]
            return (workers, machines, apps) == ({"ams-1": "alive", "ams-2": "alive"}, 2, ["demo"])

        assert eventually_true(console_shows_the_cluster), seen[-1:]
        ask = urllib.request.Request(console_url, headers={"Cookie": cookie})
        with urllib.request.urlopen(ask, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/html")
            page = resp.read().decode()
        assert 'id="worker-ams-1" data-status="alive"' in page
        assert 'id="worker-ams-2" data-status="alive"' in page

        # Secure by default: the CA, keys and tokens are the owner's alone, and the grpcurl
        # commands `up` prints (TLS checked with its CA, the admin token) work as printed.
        for name in ("tls/ca.pem", "tls/ca.key", "tls/flaps.key", "token-keys", "admin.token"):
            assert (state / name).stat().st_mode & 0o777 == 0o600, name
        printed = [line.strip() for line in text.splitlines() if "ListRegions" in line]
        assert printed, text
        assert "-cacert" in printed[0]
        assert "authorization: Bearer" in printed[0]
        # In a shell where `source .venv/bin/activate` ran, as `up` tells its user to do.
        activated = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
        listed = subprocess.run(
            ["bash", "-c", printed[0]],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=30,
            env=activated,
        )
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout)["regions"][0]["name"] == "ams"

        # Each worker's flyd runs in a memory cgroup of its own, limited: whatever a machine
        # makes it do, it cannot take the host's memory.
        for w in json.loads((state / "workers.json").read_text()):
            assert in_limited_memory_cgroup(state, w["worker_id"], w["pid"])

        status = nonomad("--state-dir", str(state), "status", "--json")
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert [r["worker"] for r in report] == ["ams-1", "ams-2"]
        assert sum(r["machines"].get("started", 0) for r in report) == 1
        # Its standby waits, created and stopped, on the other worker of the region.
        by_state = sorted(tuple(sorted(r["machines"].items())) for r in report)
        assert by_state == [(("created", 1),), (("started", 1),)]

        # The other commands find this cluster's flaps and image source from its state dir.
        demo = listed_until(state, "demo", 2)
        assert {m["state"] for m in demo} == {"MACHINE_STATE_STARTED", "MACHINE_STATE_CREATED"}
        src = tmp_path / "src"
        src.mkdir()
        (src / "run.sh").write_text("echo hi\n")
        built = nonomad(
            "--state-dir", str(state), "image", "build", str(src), "--tag", "hi:v1",
            "--entrypoint", "sh run.sh", "--app", "hi", "--json",
        )  # fmt: skip
        assert built.returncode == 0, built.stderr
        assert json.loads(built.stdout)["out"] == str(state / "images")
        # The demo image is the demo's: another app's machine of it is refused, by flaps,
        # before any worker is asked (issue 27, attack 11).
        foreign = nonomad(
            "--state-dir", str(state), "machines", "run", "bapp", "--image", "demo:v1",
            "--region", "ams",
        )  # fmt: skip
        assert foreign.returncode == 1, foreign.stdout
        assert "config.image: image 'demo:v1' is app demo's and not shared with app bapp" in (
            foreign.stderr
        )
        assert listed_until(state, "bapp", 0) == []

        # `up` deployed the demo spec; deploying it again through the CLI changes nothing.
        spec = tmp_path / "app.toml"
        demo_toml = (REPO_ROOT / "nonomad" / "demo" / "app.toml").read_text()
        spec.write_text(demo_toml.replace("syd = 1\n", ""))
        again = nonomad("--state-dir", str(state), "deploy", str(spec), "--json")
        assert again.returncode == 0, again.stderr
        deployed = json.loads(again.stdout)
        assert (deployed["created"], deployed["updated"]) == ([], [])
        assert sorted(deployed["unchanged"]) == sorted(m["id"] for m in demo)

        # A failover to watch: the primary's worker is killed; `up` says so and keeps running,
        # the standby answers through the edge, and after a restart the roles have swapped.
        [primary] = [m for m in demo if m["state"] == "MACHINE_STATE_STARTED"]
        [standby] = [m for m in demo if m["id"] != primary["id"]]
        victim = str(primary["worker_id"])
        killed = nonomad("--state-dir", str(state), "workers", "kill", victim)
        assert killed.returncode == 0, killed.stderr
        assert killed.stdout.startswith(f"{victim} killed (SIGKILL, pid ")
        assert f"{victim} exited (killed by SIGKILL); the cluster keeps running" in read_until(
            up, f"{victim} exited"
        )
        assert f"hello from machine {standby['id']}" in through_proxy(
            edge.group(2), edge.group(1), served_by=str(standby["id"])
        )
        restarted = nonomad("--state-dir", str(state), "workers", "restart", victim)
        assert restarted.returncode == 0, restarted.stderr
        assert f"{victim} restarted on its data dir" in restarted.stdout

        def swapped() -> bool:
            rows = {m["id"]: m for m in listed_until(state, "demo", 2)}
            old, new = rows[primary["id"]], rows[standby["id"]]
            return (
                old["state"] == "MACHINE_STATE_STOPPED"
                and old["slot"]["primary"] == new["id"]
                and new["state"] == "MACHINE_STATE_STARTED"
            )

        assert eventually_true(swapped)
        now = {w["worker_id"]: w["pid"] for w in json.loads((state / "workers.json").read_text())}
        assert in_limited_memory_cgroup(state, victim, now[victim])  # restarted: the same cgroup
        listed = nonomad("--state-dir", str(state), "machines", "list", "demo")
        roles = {line.split()[0]: line.split()[3:5] for line in listed.stdout.splitlines()[1:]}
        assert roles == {primary["id"]: ["standby", "g1"], standby["id"]: ["primary", "g1"]}

        workers = json.loads((state / "workers.json").read_text())
        down = nonomad("--state-dir", str(state), "down")
        assert down.returncode == 0, down.stderr
        assert up.wait(30) == 0
        assert not any(alive(w["pid"]) for w in workers)
        assert not (state / "up.pid").exists()
        # Nor its workers' cgroups: named for this state dir, they would never be used again.
        left = [
            cg
            for w in workers
            for cg in Path("/sys/fs/cgroup").glob(f"*/{cgroup_prefix(state, w['worker_id'])}")
        ]
        assert left == []
        assert not any(worker_memory_cgroup(state, w["worker_id"]).exists() for w in workers)
    finally:
        stop_up(up)


def in_limited_memory_cgroup(state: Path, worker_id: str, pid: int) -> bool:
    """Whether the process is in the worker's flyd memory cgroup, limited to `up`'s default."""
    cg = worker_memory_cgroup(state, worker_id)
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    [memory] = [line.split(":", 2)[2] for line in lines if line.split(":")[1] == "memory"]
    limit = int((cg / "memory.limit_in_bytes").read_text())
    return memory == f"/{cg.name}" and limit == 1024 << 20


def listed_until(state: Path, app: str, count: int) -> list[dict[str, object]]:
    """`machines list APP --json` once flaps' registry has `count` machines of the app."""
    deadline = time.monotonic() + 30
    while True:
        result = nonomad("--state-dir", str(state), "machines", "list", app, "--json")
        assert result.returncode == 0, result.stderr
        machines: list[dict[str, object]] = json.loads(result.stdout)
        if len(machines) == count or time.monotonic() > deadline:
            assert len(machines) == count, machines
            return machines
        time.sleep(0.2)


def test_status_without_a_cluster_fails_clearly(tmp_path: Path) -> None:
    result = nonomad("--state-dir", str(tmp_path / "none"), "status")
    assert result.returncode == 1
    assert "no cluster runs from" in result.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ["--workers-per-region", "0"],
        ["--worker-memory", "-1"],
        ["--worker-memory", "64"],  # flyd would be OOM-killed while it starts
    ],
)
def test_bad_flags_exit_2(tmp_path: Path, flags: list[str]) -> None:
    result = nonomad("--state-dir", str(tmp_path), "up", *flags)
    assert result.returncode == 2
    assert flags[0] in result.stderr
    assert not list(tmp_path.iterdir())  # nothing was started or made


def _roles(state: Path) -> dict[str, tuple[str, str, int]]:
    """Each demo machine in ams: (state, the primary its slot names, generation)."""
    rows = listed_until(state, "demo", 2)
    return {
        str(m["id"]): (
            str(m["state"]),
            str(m["slot"]["primary"]),  # type: ignore[index]
            int(m["slot"].get("generation", 0)),  # type: ignore[union-attr]
        )
        for m in rows
    }


def test_workers_pause_resume_and_a_host_death_fail_over_and_settle(tmp_path: Path) -> None:
    """`workers pause` then `resume` (a hang) and `workers kill --with-machines` then `restart`
    (a host death): each time the standby serves, and after the return the slot is back to
    one started primary and one stopped standby."""
    state = tmp_path / "cluster"
    up, text = up_demo(state)
    try:
        edge = re.search(r"-H 'Host: (demo\.[a-z.]+)' http://(127\.0\.0\.1:\d+)/", text)
        assert edge, text
        host, address = edge.group(1), edge.group(2)
        demo = listed_until(state, "demo", 2)
        [primary] = [str(m["id"]) for m in demo if m["state"] == "MACHINE_STATE_STARTED"]
        [standby] = [str(m["id"]) for m in demo if m["id"] != primary]
        workers = {str(m["id"]): str(m["worker_id"]) for m in demo}

        def one_primary(serving: str, generation: int) -> bool:
            roles = _roles(state)
            other = standby if serving == primary else primary
            return roles[serving] == ("MACHINE_STATE_STARTED", serving, generation) and roles[
                other
            ] == ("MACHINE_STATE_STOPPED", serving, generation)

        # A hang: the primary's worker is paused; the standby serves; on resume, roles swap.
        hung = workers[primary]
        paused = nonomad("--state-dir", str(state), "workers", "pause", hung)
        assert paused.returncode == 0, paused.stderr
        assert paused.stdout.startswith(f"{hung} paused (SIGSTOP, pid ")
        assert f"{hung} is paused (SIGSTOP)" in read_until(up, f"{hung} is paused")
        assert f"hello from machine {standby}" in through_proxy(address, host, served_by=standby)
        resumed = nonomad("--state-dir", str(state), "workers", "resume", hung)
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.startswith(f"{hung} resumed (SIGCONT, pid ")
        assert eventually_true(lambda: one_primary(standby, 1))

        # A host death: the now serving worker dies with its machines; the old primary is
        # promoted back (generation 2, its own); after the restart its copy stands by.
        dead = workers[standby]
        killed = nonomad("--state-dir", str(state), "workers", "kill", dead, "--with-machines")
        assert killed.returncode == 0, killed.stderr
        assert killed.stdout.startswith(f"{dead} killed (SIGKILL, pid ")
        assert killed.stdout.rstrip().endswith("and its 1 machine(s), as if the host died")
        assert f"{dead} exited (killed by SIGKILL)" in read_until(up, f"{dead} exited")
        assert f"hello from machine {primary}" in through_proxy(address, host, served_by=primary)
        restarted = nonomad("--state-dir", str(state), "workers", "restart", dead)
        assert restarted.returncode == 0, restarted.stderr
        assert eventually_true(lambda: one_primary(primary, 2))

        down = nonomad("--state-dir", str(state), "down")
        assert down.returncode == 0, down.stderr
        assert up.wait(30) == 0
    finally:
        stop_up(up)
