"""The edge's traced scenarios, each one trace across real processes exporting to a real OTLP
receiver: an HTTP request to an app with no started machine (the proxy's autostart through
flaps and flyd, to the response), and a worker killed (the proxy's failover, flaps starting the
standby on another worker)."""

from __future__ import annotations

import secrets
from pathlib import Path

from tests.e2e.otlp import OtlpReceiver, Span, SpanKind, child
from tests.proxy.support import get, proxy_fleet

SERVER, CLIENT = SpanKind.SPAN_KIND_SERVER, SpanKind.SPAN_KIND_CLIENT
INTERNAL = SpanKind.SPAN_KIND_INTERNAL
FLAPS_START = "/flaps.v1.MachinesService/StartMachine"
FLYD_START = "/flyd.v1.WorkerService/StartMachine"


async def start_chain(
    otlp: OtlpReceiver, parent: Span, machine_id: str, worker: str, op_name: str = "flyd.start"
) -> None:
    """Under `parent` (a proxy span): proxy -> flaps -> the machine's worker -> its start
    operation (`flyd.promote` for a standby), whose last committed step is the machine started."""
    call = await child(otlp, parent, FLAPS_START, CLIENT, "proxy")
    served = await child(otlp, call, FLAPS_START, SERVER, "flaps")
    forward = await child(otlp, served, FLYD_START, CLIENT, "flaps")
    on_worker = await child(otlp, forward, FLYD_START, SERVER, "flyd")
    assert on_worker.resource["nonomad.worker"] == worker
    op = await child(otlp, on_worker, op_name, INTERNAL, "flyd")
    assert op.attributes["nonomad.machine_id"] == machine_id
    steps = [e.attributes for e in op.events if e.name == "step"]
    assert steps, op.events
    assert steps[-1]["to_state"] == "started", steps


async def test_a_cold_request_is_one_trace_from_the_edge_to_the_worker_and_back(
    tmp_path: Path, image_source: Path, otlp: OtlpReceiver
) -> None:
    async with proxy_fleet(tmp_path, image_source, env=otlp.env()) as fleet:
        fleet.add_worker("w1")
        fleet.start_flaps()
        await fleet.until_alive()
        cold = await fleet.create("cold", skip_launch=True)
        proxy = fleet.add_proxy()
        await fleet.until_routed("cold", 1)

        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        reply = await get(
            proxy.http, "cold", headers={"traceparent": f"00-{trace_id}-{client_span}-01"}
        )
        assert reply.status == 200
        assert reply.headers["nonomad-machine-id"] == cold.id

        request = await otlp.until(
            lambda s: s.trace_id == trace_id and s.name == "HTTP GET", what="the request span"
        )
        assert (request.parent_span_id, request.kind, request.service) == (
            client_span,
            SERVER,
            "proxy",
        )
        assert request.resource["cloud.region"] == "ams"
        assert request.attributes["nonomad.app"] == "cold"
        assert request.attributes["nonomad.machine_id"] == cold.id
        assert request.attributes["http.response.status_code"] == 200
        await start_chain(otlp, request, cold.id, "w1")
        assert {s.service for s in otlp.trace(trace_id)} == {"proxy", "flaps", "flyd"}


async def test_a_killed_worker_is_one_failover_trace_ending_in_the_standby_started(
    tmp_path: Path, image_source: Path, otlp: OtlpReceiver
) -> None:
    async with proxy_fleet(tmp_path, image_source, env=otlp.env()) as fleet:
        await fleet.add_workers("w1", "w2")
        fleet.start_flaps()
        await fleet.until_alive()
        primary = await fleet.create("db")
        standby = await fleet.create("db", standby_for=[primary.id])
        proxy = fleet.add_proxy()
        await fleet.until_routed("db", 2)
        assert (await get(proxy.http, "db")).headers["nonomad-machine-id"] == primary.id

        fleet.workers[primary.worker_id].kill()

        failover = await otlp.until(
            lambda s: s.name == "proxy.failover" and s.service == "proxy", what="the failover"
        )
        assert (failover.parent_span_id, failover.kind) == ("", INTERNAL)
        assert failover.attributes["nonomad.worker"] == primary.worker_id
        assert failover.attributes["nonomad.region"] == "ams"
        assert failover.attributes["nonomad.standbys_started"] == 1
        await start_chain(otlp, failover, standby.id, standby.worker_id, "flyd.promote")
        # Exactly one failover, one promotion: nothing else in the trace started a machine.
        starts = [
            s for s in otlp.trace(failover.trace_id) if s.name in ("flyd.start", "flyd.promote")
        ]
        assert len(starts) == 1
        reply = await get(proxy.http, "db")
        assert reply.headers["nonomad-machine-id"] == standby.id
