"""nonomad.deploy against a real fleet: ams-1 and ams-2 in ams, syd-1 alone in syd."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from nonomad.client import Client, state_name
from nonomad.deploy import GONE, DeployEvent, deploy
from nonomad.spec import META_DIGEST
from tests.deploy.support import (
    by_name,
    http_get,
    make_spec,
    run_cli,
    spec_data,
    write_spec,
)
from tests.flaps.conftest import Fleet
from tests.harness import channel


async def three_workers(fleet: Fleet, syd_memory: int = 512) -> Client:
    fleet.add_worker("ams-1", "ams", "--capacity.memory-mib", "512")
    fleet.add_worker("ams-2", "ams", "--capacity.memory-mib", "512")
    fleet.add_worker("syd-1", "syd", "--capacity.memory-mib", str(syd_memory))
    fleet.add_flaps()
    await fleet.until_alive()
    assert fleet.security is not None
    # What a deploy pipeline holds: a token for its app's machines, not the fleet's.
    token = fleet.security.keyring().mint(["apps = web", "ops = deploy"])
    return fleet.client(timeout=20, token=token)


def steps(events: list[DeployEvent], *kinds: str) -> list[tuple[str, str]]:
    return [(e.kind, e.slot) for e in events if e.kind in kinds]


@contextlib.contextmanager
def no_dialling(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """Every connection this process tries to open meanwhile, refused and recorded (gRPC's
    own connections are the C core's, not Python sockets)."""
    tried: list[tuple[Any, ...]] = []

    def refuse(*args: Any, **kw: Any) -> Any:
        tried.append(args[1:])
        raise ConnectionRefusedError("the deploy client must not dial a machine")

    async def refuse_async(*args: Any, **kw: Any) -> Any:
        return refuse(*args, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket.socket, "connect_ex", refuse)
        patch.setattr(asyncio.BaseEventLoop, "create_connection", refuse_async)
        patch.setattr(asyncio.BaseEventLoop, "sock_connect", refuse_async)
        yield tried


async def test_create_with_standbys_then_nothing_to_do_then_scale_down(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with await three_workers(fleet) as flaps:
        # A dry run on the empty app: everything to create, where it would go; nothing made.
        first = write_spec(tmp_path, spec_data(regions={"ams": 2, "syd": 1}), "first.toml")
        code, out, err = await run_cli(flaps, first, capsys, "--dry-run")
        spec_digest = make_spec().digest
        assert code == 0, err
        rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:] if line}
        assert rows["web-ams-1"][:3] == ["primary", "ams", "create"]
        assert rows["web-syd-1"][:4] == ["primary", "syd", "create", "-"]
        assert " ".join(rows["web-syd-1"][4:]) == "on syd-1"
        # A standby avoids the worker its new primary would get; syd has no other.
        assert rows["web-ams-1-standby"][4] == "on"
        assert rows["web-ams-1-standby"][5] != rows["web-ams-1"][5]
        assert " ".join(rows["web-syd-1-standby"][4:]) == "no room (standby_conflict: 1)"
        assert f"web ({spec_digest}): 6 create; dry run, nothing changed" in out
        assert await flaps.list_machines("web") == []

        spec = make_spec(regions={"ams": 2, "syd": 1})
        events: list[DeployEvent] = []
        report = await deploy(flaps, spec, on_event=events.append)
        assert report.ok, report.reason

        machines = await by_name(flaps)
        assert set(machines) == {
            "web-ams-1",
            "web-ams-1-standby",
            "web-ams-2",
            "web-ams-2-standby",
            "web-syd-1",
        }
        assert sorted(report.created) == sorted(m.id for m in machines.values())
        for n in (1, 2):
            primary = machines[f"web-ams-{n}"]
            standby = machines[f"web-ams-{n}-standby"]
            assert state_name(primary.state) == "started"
            assert state_name(standby.state) in {"created", "stopped"}
            assert standby.worker_id != primary.worker_id
            assert list(standby.config.standbys) == [primary.id]
            assert (await http_get(primary)).startswith(f"hello from {primary.id}")
            # Each primary was checked before its standby was made.
            order = steps(events, "passed", "created")
            assert order.index(("passed", primary.name)) < order.index(("created", standby.name))
        # syd has a single worker: its primary runs, with nowhere for a standby.
        assert state_name(machines["web-syd-1"].state) == "started"
        assert [w for w in report.warnings if "syd" in w] == [
            f"no standby for {machines['web-syd-1'].id} in syd: no other worker"
        ]
        assert {(r.slot, r.machine_id) for r in report.machines} == {
            (name, m.id) for name, m in machines.items()
        }

        # The same deploy again changes nothing.
        again = await deploy(flaps, spec)
        assert again.ok, again.reason
        assert (again.created, again.updated, again.destroyed) == ([], [], [])
        assert sorted(again.unchanged) == sorted(report.created)
        assert {n: m.instance_id for n, m in (await by_name(flaps)).items()} == {
            n: m.instance_id for n, m in machines.items()
        }

        # Lowering ams to 1: the dry run shows it and changes nothing...
        smaller = spec_data(regions={"ams": 1, "syd": 1})
        path = write_spec(tmp_path, smaller)
        code, out, err = await run_cli(flaps, path, capsys, "--dry-run", "--json")
        assert code == 0, err
        planned = {s["slot"]: s["action"] for s in json.loads(out)["slots"]}
        assert planned == {
            "web-ams-1": "unchanged",
            "web-ams-1-standby": "unchanged",
            "web-syd-1": "unchanged",
            "web-syd-1-standby": "create",
            "web-ams-2": "destroy",
            "web-ams-2-standby": "destroy",
        }
        assert {n: m.instance_id for n, m in (await by_name(flaps)).items()} == {
            n: m.instance_id for n, m in machines.items()
        }

        # ...and the deploy destroys the extra machine with its standby, standby first.
        events.clear()
        code, out, err = await run_cli(flaps, path, capsys)
        assert code == 0, err
        destroyed = [line.split()[1] for line in out.splitlines() if "destroyed " in line]
        assert destroyed == ["web-ams-2-standby", "web-ams-2"]
        gone = [machines["web-ams-2-standby"].id, machines["web-ams-2"].id]
        assert set(await by_name(flaps)) == {"web-ams-1", "web-ams-1-standby", "web-syd-1"}
        for machine_id in gone:
            assert state_name((await flaps.get_machine(machine_id)).state) == "destroyed"

        # Wanted again, the slot gets a new machine: the idempotency key that named the
        # destroyed one moves on to its next generation.
        back = await deploy(flaps, spec)
        assert back.ok, back.reason
        machines = await by_name(flaps)
        assert sorted(back.created) == sorted(
            [machines["web-ams-2"].id, machines["web-ams-2-standby"].id]
        )
        assert not set(back.created) & set(gone)
        assert state_name(machines["web-ams-2"].state) == "started"


async def test_rolling_update_keeps_ids_and_goes_one_at_a_time(fleet: Fleet) -> None:
    async with await three_workers(fleet) as flaps:
        first = await deploy(flaps, make_spec())
        assert first.ok, first.reason
        before = await by_name(flaps)

        events: list[DeployEvent] = []
        changed = make_spec(env={"GREETING": "v2"})
        report = await deploy(flaps, changed, on_event=events.append)
        assert report.ok, report.reason
        assert report.created == []
        assert sorted(report.updated) == sorted(m.id for m in before.values())

        after = await by_name(flaps)
        assert set(after) == set(before)
        for name, machine in after.items():
            assert machine.id == before[name].id
            assert machine.instance_id != before[name].instance_id
            assert machine.config.env["GREETING"] == "v2"
            assert machine.config.metadata[META_DIGEST] == changed.digest
        for n in (1, 2):
            primary, standby = after[f"web-ams-{n}"], after[f"web-ams-{n}-standby"]
            assert state_name(primary.state) == "started"
            assert (await http_get(primary)).startswith(f"hello from {primary.id}")
            assert state_name(standby.state) in {"created", "stopped"}
            assert list(standby.config.standbys) == [primary.id]

        # One machine at a time, each primary passing its checks before its standby and
        # before the next primary is touched.
        assert steps(events, "updating", "checking", "passed", "updated", "failed") == [
            ("updating", "web-ams-1"),
            ("checking", "web-ams-1"),
            ("passed", "web-ams-1"),
            ("updating", "web-ams-1-standby"),
            ("updated", "web-ams-1-standby"),
            ("updating", "web-ams-2"),
            ("checking", "web-ams-2"),
            ("passed", "web-ams-2"),
            ("updating", "web-ams-2-standby"),
            ("updated", "web-ams-2-standby"),
        ]


async def test_a_deploy_never_dials_a_machine_from_the_client(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers run the checks; the client only asks flyd (through flaps) whether each
    machine serves: its machines' addresses may be private to the workers' hosts."""
    async with await three_workers(fleet) as flaps:
        spec = make_spec(regions={"ams": 1})
        with no_dialling(monkeypatch) as tried:
            created = await deploy(flaps, spec)
            updated = await deploy(flaps, make_spec(regions={"ams": 1}, env={"GREETING": "v2"}))
        assert tried == []
        assert created.ok, created.reason
        assert updated.ok, updated.reason
        [primary] = [m for m in (await by_name(flaps)).values() if not m.config.standbys]
        assert updated.updated[0] == primary.id
        assert primary.ready.ready, primary.ready
        # The check ran all the same, on its worker: the machine answers.
        assert (await http_get(primary)).startswith(f"hello from {primary.id}")


async def test_an_update_after_a_failover_keeps_each_copy_in_its_role(fleet: Fleet) -> None:
    """The standby took over (promoted; the old primary superseded, stopped): a rolling update
    gates the serving copy and keeps the old primary, now a standby, stopped."""
    async with await three_workers(fleet) as flaps:
        spec = make_spec(regions={"ams": 1})
        first = await deploy(flaps, spec)
        assert first.ok, first.reason
        before = await by_name(flaps)
        primary, standby = before["web-ams-1"], before["web-ams-1-standby"]
        promoted = await flaps.start_machine(standby.id)
        assert (promoted.slot.generation, promoted.slot.primary) == (1, standby.id)
        await flaps.supersede_machine(primary.id, 1, standby.id)
        await flaps.wait_machine(primary.id, "stopped", wait=30)

        report = await deploy(flaps, make_spec(regions={"ams": 1}, env={"GREETING": "v2"}))
        assert report.ok, report.reason
        after = await by_name(flaps)
        old, new = after["web-ams-1"], after["web-ams-1-standby"]
        assert state_name(old.state) == "stopped"
        assert (old.slot.primary, old.config.env["GREETING"]) == (standby.id, "v2")
        assert state_name(new.state) == "started"
        assert new.config.env["GREETING"] == "v2"
        assert (await http_get(new)).startswith(f"hello from {new.id}")


async def test_a_failing_check_rolls_back_and_run_exits_1(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with await three_workers(fleet) as flaps:
        good = make_spec()
        assert (await deploy(flaps, good)).ok
        before = await by_name(flaps)

        # The new config adds an admin port the app never listens on, and checks it.
        bad = spec_data(
            services=[{"internal_port": 8080}, {"internal_port": 9090}],
            checks=[
                *spec_data()["checks"],
                {"name": "admin", "type": "tcp", "port": 9090, "grace_period": "0.5s"},
            ],
        )
        code, out, err = await run_cli(flaps, write_spec(tmp_path, bad), capsys, "--json")
        assert code == 1
        report = json.loads(out)
        first = before["web-ams-1"]
        assert report["ok"] is False
        assert report["failure"]["slot"] == "web-ams-1"
        assert report["failure"]["machine_id"] == first.id
        assert report["failure"]["check"] == "admin", report["failure"]
        # flyd's words, from the worker that ran the check.
        observed = report["failure"]["observed"]
        assert observed.startswith("check admin: nothing listening on port 9090"), observed
        assert report["updated"] == [first.id]
        assert report["rolled_back"] == [first.id]
        [message] = [line for line in err.splitlines() if line.startswith("nonomad deploy:")]
        assert message.startswith("nonomad deploy: failed: web-ams-1 ")
        assert f"({first.id}) is not ready: check admin: nothing listening on port 9090" in message
        kinds = [(e["kind"], e["slot"]) for e in report["events"]]
        assert kinds.index(("failed", "web-ams-1")) < kinds.index(("rolling_back", "web-ams-1"))
        [rolled] = [e for e in report["events"] if e["kind"] == "rolled_back"]
        assert rolled["slot"] == "web-ams-1"
        assert rolled["detail"] == "previous config, started, checks pass"
        assert not any(kind == "updating" and slot != "web-ams-1" for kind, slot in kinds)

        after = await by_name(flaps)
        restored = after["web-ams-1"]
        assert restored.id == first.id
        assert restored.instance_id not in (first.instance_id, "")
        assert restored.config.metadata[META_DIGEST] == good.digest
        assert [p.internal_port for p in restored.ports] == [8080]
        assert state_name(restored.state) == "started"
        assert (await http_get(restored)).startswith(f"hello from {first.id}")
        # Nothing else was touched.
        for name in ("web-ams-1-standby", "web-ams-2", "web-ams-2-standby"):
            assert after[name].instance_id == before[name].instance_id


async def test_a_region_without_room_for_the_whole_plan_fails_before_anything_changes(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # syd has room for one machine of 128 MiB; the spec asks for two there. Each slot asked on
    # its own would fit: the plan is checked as a whole.
    async with await three_workers(fleet, syd_memory=200) as flaps:
        data = spec_data(regions={"syd": 2}, standbys=0, guest={"memory_mib": 128})
        code, out, err = await run_cli(flaps, write_spec(tmp_path, data), capsys, "--dry-run")
        assert code == 1
        assert "web-syd-2" in out  # the plan is still shown
        assert "would fail: no room: region syd has room for 1, the plan creates 2" in err
        assert await flaps.list_machines("web") == []

        events: list[DeployEvent] = []
        report = await deploy(flaps, make_spec(**data), on_event=events.append)
        assert not report.ok
        assert report.failure is not None
        assert report.failure.region == "syd"
        assert report.reason == "no room: region syd has room for 1, the plan creates 2"
        assert report.created == []
        assert steps(events, "creating") == []
        assert await flaps.list_machines("web") == []


BROKEN = {  # Python cannot even start with this; the worker gives up after one retry
    "env": {"PYTHONHOME": "/nonexistent"},
    "restart": {"policy": "on-failure", "max_retries": 1},
    "checks": [{"type": "http", "interval": "100ms", "grace_period": "1s"}],
}


async def test_a_deploy_that_fails_part_way_destroys_what_it_created(fleet: Fleet) -> None:
    async with await three_workers(fleet) as flaps:
        events: list[DeployEvent] = []
        report = await deploy(
            flaps, make_spec(regions={"ams": 1}, **BROKEN), on_event=events.append
        )
        assert not report.ok
        [created] = report.created
        assert report.undone == [created]
        assert f"destroyed what it created: {created}" in report.reason
        assert "kept" not in report.reason
        assert steps(events, "undone") == [("undone", "")]
        assert [m for m in await flaps.list_machines("web") if m.state not in GONE] == []


async def test_keep_created_keeps_what_a_failed_deploy_made(fleet: Fleet) -> None:
    async with await three_workers(fleet) as flaps:
        report = await deploy(flaps, make_spec(regions={"ams": 1}, **BROKEN), keep_created=True)
        assert not report.ok
        [created] = report.created
        assert report.undone == []
        assert f"changed and kept: {created}" in report.reason
        [kept] = await flaps.list_machines("web")
        assert kept.id == created


async def test_an_app_that_crashes_with_the_new_env_is_rolled_back(fleet: Fleet) -> None:
    async with await three_workers(fleet) as flaps:
        good = make_spec(regions={"ams": 1}, standbys=0)
        assert (await deploy(flaps, good)).ok
        [before] = await flaps.list_machines("web")

        broken = make_spec(regions={"ams": 1}, standbys=0, **BROKEN)
        report = await deploy(flaps, broken)
        assert not report.ok
        assert report.failure is not None
        assert report.failure.machine_id == before.id
        assert report.updated == [before.id]
        assert report.rolled_back == [before.id]

        [after] = await flaps.list_machines("web")
        assert after.id == before.id
        assert after.config.metadata[META_DIGEST] == good.digest
        assert "PYTHONHOME" not in after.config.env
        assert state_name(after.state) == "started"
        assert (await http_get(after)).startswith(f"hello from {before.id}")


async def test_machines_a_deploy_adds_get_the_apps_secrets(fleet: Fleet) -> None:
    """Secrets live on an app's machines (`nonomad secrets set` puts them there): a deploy
    that adds machines copies them from one that stays, over the cluster's mTLS only."""
    async with await three_workers(fleet) as flaps:
        report = await deploy(flaps, make_spec(regions={"ams": 1}, standbys=0))
        assert report.ok, report.reason
        [first] = (await by_name(flaps)).values()
        config = pb.MachineConfig()
        config.CopyFrom(first.config)
        config.secrets["API_KEY"] = "k-123"
        await flaps.update_machine(first.id, config)

        grown = await deploy(flaps, make_spec(regions={"ams": 2}, standbys=0))
        assert grown.ok, grown.reason
        assert not [w for w in grown.warnings if "secrets" in w], grown.warnings
        [added] = grown.created
        machine = await flaps.get_machine(added)
        assert dict(machine.config.secrets) == {"API_KEY": "<redacted>"}
        # Read back as flaps reads them: only its certificate may.
        assert fleet.security is not None
        as_flaps = worker_pb2_grpc.WorkerServiceStub(
            channel(fleet.workers[machine.worker_id].address, fleet.security.member_tls("flaps"))
        )
        opened = await as_flaps.RevealSecrets(w.RevealSecretsRequest(machine_id=added), timeout=10)
        assert dict(opened.secrets) == {"API_KEY": "k-123"}
