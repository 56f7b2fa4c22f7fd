"""The console's pages as data (nonomad.console.model) and its small decisions, without a
cluster: numbers, redaction, the feed's wording, traffic from two samples."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from starlette.requests import Request

from flaps.v1 import platform_pb2
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from nonomad.console import model
from nonomad.console.render import wants_json
from nonomad.console.settings import ConsoleSettings
from proxy.v1 import proxy_pb2
from registry.replica import WorkerView
from registry.view import ALIVE, DEAD
from runtime.settings import SettingsError, load_settings

S = pb.MachineState


def view(
    worker_id: str,
    region: str,
    *,
    free_cpu: int = 4000,
    free_mib: int = 4096,
    status: int = ALIVE,
    cordoned: bool = False,
    by_state: dict[str, int] | None = None,
) -> WorkerView:
    cap = pb.Capacity(
        total=pb.Resources(cpu_millicores=4000, memory_mib=4096, disk_mib=0, machines=100),
        free=pb.Resources(cpu_millicores=free_cpu, memory_mib=free_mib, machines=100),
        cordoned=cordoned,
        machines_by_state=by_state or {},
    )
    cap.images.add(ref="demo:v1", digest="sha256:ab", size_bytes=1234)
    info = pb.WorkerInfo(id=worker_id, region=region, address="127.0.0.1:1")
    return WorkerView(info, status, 99.0, cap, 7, True)  # type: ignore[arg-type]


def test_the_fleet_counts_reserved_of_total_per_worker_and_region() -> None:
    data = model.fleet(
        [
            view("syd-1", "syd", status=DEAD),
            view("ams-2", "ams", free_cpu=3500, free_mib=3968, cordoned=True,
                 by_state={"started": 2, "destroyed": 1}),
            view("ams-1", "ams", free_cpu=3750, by_state={"created": 1}),
        ],
        now=100.0,
    )  # fmt: skip
    assert [w["id"] for w in data["workers"]] == ["ams-1", "ams-2", "syd-1"]
    ams2 = data["workers"][1]
    assert (ams2["status"], ams2["cordoned"], ams2["heartbeat_age_s"]) == ("alive", True, 1.0)
    assert ams2["cpu"] == {"reserved": 500, "total": 4000, "percent": 12.5}
    assert ams2["memory"] == {"reserved": 128, "total": 4096, "percent": 3.1}
    assert ams2["machines"] == {
        "total": 2,  # a destroyed row is kept a while, but is no machine
        "capacity": 100,
        "by_state": {"destroyed": 1, "started": 2},
    }
    assert ams2["images"] == [{"ref": "demo:v1", "digest": "sha256:ab", "size_bytes": 1234}]
    assert data["workers"][2]["status"] == "dead"
    ams, syd = data["regions"]
    assert (ams["name"], ams["workers"], ams["alive"], ams["machines"]) == ("ams", 2, 2, 3)
    assert ams["cpu"] == {"reserved": 750, "total": 8000, "percent": 9.4}
    assert (syd["alive"], syd["machines"]) == (0, 0)
    assert data["machines_by_state"] == {"created": 1, "destroyed": 1, "started": 2}


def machine(machine_id: str, worker: str, *, standbys: tuple[str, ...] = ()) -> pb.Machine:
    m = pb.Machine(
        id=machine_id,
        app="web",
        region="ams",
        worker_id=worker,
        state=S.MACHINE_STATE_STARTED if not standbys else S.MACHINE_STATE_CREATED,
        config=pb.MachineConfig(image="web:v1", standbys=list(standbys)),
    )
    first = standbys[0] if standbys else machine_id
    m.slot.CopyFrom(pb.SlotState(id=first, primary=first))
    return m


def test_an_app_shows_who_stands_by_for_whom_and_what_the_proxy_sees() -> None:
    primary, standby = (
        machine("ams-1-a", "ams-1"),
        machine("ams-2-b", "ams-2", standbys=("ams-1-a",)),
    )
    routes = {"ams-1-a": proxy_pb2.RouteMachine(machine_id="ams-1-a", healthy=True, in_flight=3)}
    data = model.app("web", [standby, primary], {"ams-1": "dead"}, routes, None)
    first, second = data["machines"]
    assert (first["id"], first["role"], first["standbys"], first["worker_status"]) == (
        "ams-1-a",
        "primary",
        ["ams-2-b"],
        "dead",
    )
    assert first["route"]["in_flight"] == 3
    assert (second["role"], second["standby_for"], second["route"]) == (
        "standby",
        ["ams-1-a"],
        None,
    )
    assert second["worker_status"] == "unknown"
    assert (data["by_state"], data["routed"]) == ({"created": 1, "started": 1}, 1)
    assert model.app("web", [primary], {}, None, None, "down")["routed"] is None


def test_a_primary_whose_row_is_outranked_shows_superseded() -> None:
    """Its worker died before it was told: the promoted standby's row outranks it."""
    old, promoted = machine("ams-1-a", "ams-1"), machine("ams-2-b", "ams-2", standbys=("ams-1-a",))
    promoted.slot.CopyFrom(pb.SlotState(id="ams-1-a", primary="ams-2-b", generation=1))
    data = model.app("web", [old, promoted], {"ams-1": "dead"}, None, None)
    rows = {r["id"]: r for r in data["machines"]}
    assert (rows["ams-1-a"]["role"], rows["ams-1-a"]["serving"]) == ("superseded", "ams-2-b")
    assert (rows["ams-2-b"]["role"], rows["ams-2-b"]["generation"]) == ("primary", 1)


def test_an_app_of_many_machines_is_shown_a_page_at_a_time() -> None:
    many = [machine(f"ams-1-{i:04x}", "ams-1") for i in range(model.PAGE_ROWS * 2 + 50)]
    many[-1].state = S.MACHINE_STATE_STOPPED
    last = model.app("web", many, {}, {}, None, page=3)
    assert [r["id"] for r in last["machines"]] == [m.id for m in many[-50:]]
    assert last["page"] == {
        "number": 3,
        "pages": 3,
        "first": 2 * model.PAGE_ROWS + 1,
        "rows_per_page": model.PAGE_ROWS,
        "machines": 2 * model.PAGE_ROWS + 50,
    }
    # The counts are the whole app's, whichever page is shown.
    first = model.app("web", many, {}, {}, None)
    assert len(first["machines"]) == model.PAGE_ROWS
    assert (
        first["by_state"]
        == last["by_state"]
        == {
            "started": 2 * model.PAGE_ROWS + 49,
            "stopped": 1,
        }
    )
    assert model.app("web", many, {}, {}, None, page=4)["machines"] == []


def stats(
    total: int, by_status: dict[str, int], buckets: list[tuple[float, int]]
) -> proxy_pb2.AppStats:
    return proxy_pb2.AppStats(
        app="web",
        requests_total=total,
        requests_by_status=by_status,
        latency=[proxy_pb2.LatencyBucket(le_ms=b, count=n) for b, n in buckets],
        latency_sum_ms=10.0 * total,
    )


def test_traffic_is_the_difference_between_two_samples() -> None:
    before = model.Sample(10.0, stats(100, {"200": 100}, [(5, 50), (10, 100), (math.inf, 100)]))
    # 40 more requests in 4 s: 30 under 5 ms, 6 more under 10 ms, 4 slower, 4 of them 503s.
    now = model.Sample(
        14.0, stats(140, {"200": 136, "503": 4}, [(5, 80), (10, 136), (math.inf, 140)])
    )
    t = model.traffic(now, before)
    assert (t["window_s"], t["requests"], t["rate_per_s"], t["errors_5xx"]) == (4.0, 40, 10.0, 4)
    assert t["by_status"] == {"200": 36, "503": 4}
    assert t["latency_ms"] == {"mean": 10.0, "p50_at_most": 5, "p99_at_most": None}
    first = model.traffic(before, None)
    assert (first["since_proxy_start"], first["rate_per_s"], first["requests"]) == (True, None, 100)
    assert first["latency_ms"]["p50_at_most"] == 5
    assert model.traffic(model.Sample(1.0, proxy_pb2.AppStats()), None)["latency_ms"] == {
        "mean": None,
        "p50_at_most": None,
        "p99_at_most": None,
    }


def test_a_secret_is_shown_by_name_only() -> None:
    config = pb.MachineConfig(image="web:v1", env={"MODE": "prod"}, secrets={"API_KEY": "s3cr3t"})
    shown = model.config(config)
    assert shown["secrets"] == {"API_KEY": "<redacted>"}
    assert shown["env"] == {"MODE": "prod"}
    assert "s3cr3t" not in repr(shown)


def change(
    kind: str, was: int, to: int, reason: str = "", generation: int = 0
) -> worker_pb2.MachineChange:
    m = machine("ams-2-b", "ams-2", standbys=("ams-1-a",))
    event = pb.MachineEvent(
        seq=9, machine_id=m.id, type=kind, from_state=was, to_state=to, reason=reason,  # type: ignore[arg-type]
        generation=generation,
    )  # fmt: skip
    return worker_pb2.MachineChange(event=event, machine=m)


@pytest.mark.parametrize(
    ("step", "kind", "text"),
    [
        (change("create", 0, S.MACHINE_STATE_CREATED), "created",
         "created on ams-2, standing by for ams-1-a"),
        (change("promote", 1, S.MACHINE_STATE_STARTING, "promoted to generation 1", 1),
         "promoted", "promoted to generation 1"),
        (change("start", 2, S.MACHINE_STATE_STARTED, "running (pid 7)"), "started",
         "running (pid 7)"),
        (change("exit", 3, S.MACHINE_STATE_STOPPED, "exited with code 0"), "exited",
         "exited with code 0"),
        (change("stop", 4, S.MACHINE_STATE_STOPPED, "stopped"), "stopped", "stopped"),
        (change("exit", 3, S.MACHINE_STATE_FAILED, "out of retries"), "failed", "out of retries"),
        (change("destroy", 7, S.MACHINE_STATE_DESTROYED, "destroyed"), "destroyed", "destroyed"),
        (change("start", 1, S.MACHINE_STATE_STARTING), None, None),  # passing through
        (change("lease", 3, S.MACHINE_STATE_STARTED), None, None),  # no change of state
    ],
)  # fmt: skip
def test_the_feed_says_what_a_machine_did(
    step: worker_pb2.MachineChange, kind: str | None, text: str | None
) -> None:
    item = model.feed_change(step)
    if kind is None:
        assert item is None
        return
    assert item is not None
    assert (item["kind"], item["text"], item["machine_id"], item["app"]) == (
        kind,
        text,
        "ams-2-b",
        "web",
    )


def test_the_feed_says_what_placement_decided() -> None:
    placed = platform_pb2.PlacementEvent(
        app="web", region="ams", outcome="placed", machine_id="ams-1-a", worker_id="ams-1",
        score=0.8, candidates=2,
    )  # fmt: skip
    moved = platform_pb2.PlacementEvent(
        app="web", region="ams", outcome="exhausted", fallback=True,
        rejections_by_reason={"cordoned": 1, "insufficient_memory": 3},
    )  # fmt: skip
    refused = platform_pb2.PlacementEvent(app="web", region="syd", outcome="exhausted")
    assert model.feed_placement(placed)["text"] == "placed on ams-1 (score 0.800, best of 2)"
    item = model.feed_placement(moved)
    assert (item["kind"], item["text"]) == (
        "fallback",
        "no worker in ams took it (3 insufficient_memory, 1 cordoned); trying the next region",
    )
    assert model.feed_placement(refused)["kind"] == "refused"


def test_a_placement_marks_the_chosen_worker_and_orders_the_sub_scores() -> None:
    decision = pb.PlacementDecision(worker_id="ams-2", sample_size=8)
    decision.regions.add(region="syd", outcome="exhausted", rejections_by_reason={"dead": 2})
    ams = decision.regions.add(region="ams", outcome="placed", examined=2, keyed_worker_id="ams-2")
    ams.candidates.add(
        worker_id="ams-2", score=0.5, sub_scores={"spread": -1, "memory": 0.5, "cpu": 1}
    )
    ams.candidates.add(worker_id="ams-1", score=0.9, sub_scores={"cpu": 0.4, "memory": 0.5})
    data = model.placement(decision)
    assert data is not None
    syd, placed = data["regions"]
    assert (syd["outcome"], syd["candidates"], syd["rejections_by_reason"]) == (
        "exhausted",
        [],
        {"dead": 2},
    )
    assert placed["parts"] == ["cpu", "memory", "spread"]
    assert [(c["worker_id"], c["chosen"]) for c in placed["candidates"]] == [
        ("ams-2", True),
        ("ams-1", False),
    ]
    assert placed["keyed_worker_id"] == "ams-2"
    assert model.placement(None) is None


@pytest.mark.parametrize(
    ("accept", "json"),
    [
        ("application/json", True),
        ("text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", False),
        ("application/json, text/html", True),
        ("text/html, application/json", False),
        ("text/html;q=0.5, application/json;q=0.9", True),
        ("application/json;q=0", False),
        ("", False),
        ("*/*", False),
    ],
)
def test_json_when_the_client_prefers_it(accept: str, json: bool) -> None:
    request = Request({"type": "http", "headers": [(b"accept", accept.encode())]})
    assert wants_json(request) is json


def test_the_console_must_follow_something_and_its_files_must_exist(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="follows nothing"):
        load_settings(ConsoleSettings, ["--flaps", "127.0.0.1:1"], prog="nonomad-console")
    with pytest.raises(SettingsError, match="token_file: file not found"):
        load_settings(
            ConsoleSettings,
            [
                "--flaps",
                "127.0.0.1:1",
                "--upstream",
                "127.0.0.1:2",
                "--token-file",
                str(tmp_path / "x"),
            ],
            prog="nonomad-console",
        )
    ok = load_settings(
        ConsoleSettings, ["--flaps", "127.0.0.1:1", "--upstream", "127.0.0.1:2"], prog="c"
    )
    assert (ok.listen, ok.flaps_tls()) == ("127.0.0.1:8090", None)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--hosts", "evil example"], "is not a host name"),
        (["--hosts", "http://console.example"], "is not a host name"),
        (["--https-cert", "CERT"], "https_cert and https_key go together"),
        (["--session-ttl", "0"], "session_ttl"),
        (["--max-sessions", "0"], "max_sessions"),
    ],
)
def test_the_consoles_front_door_settings_are_checked(
    tmp_path: Path, args: list[str], error: str
) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("")
    base = ["--flaps", "127.0.0.1:1", "--upstream", "127.0.0.1:2"]
    given = [str(cert) if a == "CERT" else a for a in args]
    with pytest.raises(SettingsError, match=error):
        load_settings(ConsoleSettings, [*base, *given], prog="nonomad-console")
    ok = load_settings(
        ConsoleSettings,
        [*base, "--hosts", "console.example.com", "--hosts", "edge.example:443"],
        prog="nonomad-console",
    )
    assert ok.hosts == ["console.example.com", "edge.example:443"]
    assert (ok.session_ttl, ok.max_sessions, ok.https_cert) == (43200.0, 256, None)
