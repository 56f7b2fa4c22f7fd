"""One request, one trace: a traced client, flaps and two flyd workers, all real processes,
exporting to a real OTLP receiver; parent/child links across processes checked by span id."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
from typing import Any

import grpc

from tests.e2e.otlp import OtlpReceiver, SpanKind, child
from tests.flaps.conftest import Fleet
from tests.harness import REPO_ROOT, clean_env, grpcurl

SERVER, CLIENT = SpanKind.SPAN_KIND_SERVER, SpanKind.SPAN_KIND_CLIENT
FLAPS_CREATE = "/flaps.v1.MachinesService/CreateMachine"
FLAPS_WAIT = "/flaps.v1.MachinesService/WaitMachine"
FLYD_CREATE = "/flyd.v1.WorkerService/CreateMachine"
FLYD_WAIT = "/flyd.v1.WorkerService/WaitMachine"


async def run_client(address: str, env: dict[str, str]) -> dict[str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.e2e._traced_client",
        address,
        "web",
        "ams",
        cwd=REPO_ROOT,
        env=clean_env(**env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, stderr.decode()
    answer: dict[str, str] = json.loads(stdout.decode().splitlines()[-1])
    return answer


def log_lines(path: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


async def test_create_and_wait_is_one_trace_across_client_flaps_and_flyd(
    traced_fleet: Fleet, otlp: OtlpReceiver
) -> None:
    fleet = traced_fleet
    for worker_id in ("ams-1", "ams-2"):
        fleet.add_worker(worker_id, "ams", "--capacity.memory-mib", "512")
    flaps = fleet.add_flaps()
    await fleet.until_alive()

    answer = await run_client(flaps.address, otlp.env())
    assert answer["state"] == "MACHINE_STATE_STARTED"
    worker = answer["worker_id"]
    assert worker in fleet.workers

    root = await otlp.until(lambda s: s.span_id == answer["span_id"], what="the client's root")
    assert (root.trace_id, root.parent_span_id, root.service) == (
        answer["trace_id"],
        "",
        "e2e-client",
    )

    # CreateMachine: client -> flaps server -> flaps's claim -> the worker's server span.
    call = await child(otlp, root, FLAPS_CREATE, CLIENT, "e2e-client")
    served = await child(otlp, call, FLAPS_CREATE, SERVER, "flaps")
    claim = await child(otlp, served, FLYD_CREATE, CLIENT, "flaps")
    on_worker = await child(otlp, claim, FLYD_CREATE, SERVER, "flyd")
    assert on_worker.resource["nonomad.worker"] == worker
    assert on_worker.resource["cloud.region"] == "ams"
    assert served.attributes["rpc.service"] == "flaps.v1.MachinesService"

    # flyd's create operation is a span under its RPC span, one event per committed step, and
    # it ends at rest: the last step is the machine STARTED.
    op = await child(otlp, on_worker, "flyd.create", SpanKind.SPAN_KIND_INTERNAL, "flyd")
    assert op.attributes["nonomad.machine_id"] == answer["machine_id"]
    assert (op.attributes["nonomad.app"], op.attributes["nonomad.worker"]) == ("web", worker)
    steps = [e.attributes for e in op.events if e.name == "step"]
    assert steps, op.events
    assert steps[-1]["to_state"] == "started"
    assert [s["seq"] for s in steps] == sorted(s["seq"] for s in steps)

    # The placement decision rides on flaps's server span.
    decision = served.event("placement.decision").attributes
    assert decision["region"] == "ams"
    assert decision["outcome"] == "placed"
    assert decision["winner"] == worker
    assert decision["examined"] == 2
    assert decision["rejections"] == ()
    candidates = dict(c.split("=") for c in decision["candidates"])
    assert set(candidates) == {"ams-1", "ams-2"}
    assert len(decision["sub_scores"]) == 2
    for line in decision["sub_scores"]:
        worker_id, _, scores = line.partition(":")
        assert worker_id in candidates
        assert {kv.split("=")[0] for kv in scores.split(",")} == {"cpu", "memory", "image_cached"}

    # WaitMachine: the same chain, in the same trace.
    wait_call = await child(otlp, root, FLAPS_WAIT, CLIENT, "e2e-client")
    wait_served = await child(otlp, wait_call, FLAPS_WAIT, SERVER, "flaps")
    wait_forward = await child(otlp, wait_served, FLYD_WAIT, CLIENT, "flaps")
    wait_on_worker = await child(otlp, wait_forward, FLYD_WAIT, SERVER, "flyd")
    assert wait_on_worker.resource["nonomad.worker"] == worker

    # One trace holds all three processes; nothing of it went to another trace.
    spans = otlp.trace(root.trace_id)
    assert {s.service for s in spans} >= {"e2e-client", "flaps", "flyd"}
    chain = [call, served, claim, on_worker, wait_call, wait_served, wait_forward, wait_on_worker]
    assert {s.trace_id for s in chain} == {root.trace_id}

    # flaps's log line for the placement carries the ids of the span it was written in.
    [placed] = [
        line
        for line in log_lines(fleet.tmp / "flaps-0.log")
        if line["event"] == "placed" and line.get("machine_id") == answer["machine_id"]
    ]
    assert (placed["trace_id"], placed["span_id"]) == (served.trace_id, served.span_id)

    # A bid nobody can take, sent by grpcurl under a caller's own trace context: the refusal
    # is traced too, with every rejection on the decision.
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    guest = {"cpu_millicores": 100, "memory_mib": 600}
    body = {"app": "big", "region": "ams", "config": {"image": "demo:v1", "guest": guest}}
    refused = await asyncio.to_thread(
        grpcurl,
        "-plaintext",
        "-H",
        f"traceparent: 00-{trace_id}-{parent_id}-01",
        "-d",
        json.dumps(body),
        flaps.address,
        FLAPS_CREATE.lstrip("/"),
    )
    assert "ResourceExhausted" in refused.stderr, refused.stderr
    failed = await otlp.until(
        lambda s: s.trace_id == trace_id and s.name == FLAPS_CREATE, what="the refused create"
    )
    assert (failed.parent_span_id, failed.kind, failed.service) == (parent_id, SERVER, "flaps")
    # The code is on the span (the semantic conventions leave a server span's status unset
    # for RESOURCE_EXHAUSTED: the caller's mistake or the fleet's state, not the server's).
    assert failed.attributes["rpc.grpc.status_code"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    decision = failed.event("placement.decision").attributes
    assert (decision["outcome"], decision["winner"], decision["candidates"]) == (
        "exhausted",
        "",
        (),
    )
    # Both workers are too small: the placement index counts them by reason without drawing
    # (and so without naming) either.
    assert decision["rejections_by_reason"] == ("insufficient_memory=2",)
    assert decision["rejections"] == ()
    assert otlp.children(failed) == []  # no worker was asked
