"""What each page shows, as plain data: the JSON twin of every page, and what its template
renders. Pure functions from the cluster's messages (replica views, machines, the proxy's
routes and stats, placement decisions) to dicts of str, int, float, bool, list and dict.

Nothing here does I/O, so a page's content is tested without a cluster.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

from flaps.v1 import platform_pb2
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from model.slots import Claim, claim, outranks, slot_of
from model.validate import REDACTED
from nonomad.client import state_name
from proxy.v1 import proxy_pb2
from registry.replica import WorkerView, status_name

Data = dict[str, Any]

# The states a machine passes through on its way somewhere; the rest are where it rests.
_RESTING = ("created", "started", "stopped", "failed", "destroyed")
PAGE_ROWS = 100
"""An app's machines a page shows: a browser lays out a few hundred table rows slowly."""


def iso(ts: Timestamp) -> str:
    """A timestamp as RFC 3339 in UTC to the millisecond; "" when unset."""
    if not ts.seconds and not ts.nanos:
        return ""
    return ts.ToDatetime().isoformat(timespec="milliseconds") + "Z"


def _share(reserved: int, total: int) -> Data:
    return {
        "reserved": reserved,
        "total": total,
        "percent": round(100 * reserved / total, 1) if total > 0 else 0.0,
    }


# -- the fleet ---------------------------------------------------------------------------------


def worker(view: WorkerView, now: float) -> Data:
    """One worker: liveness, cordon, CPU and memory reserved of total, machines by state, the
    images it caches (as of its last heartbeat)."""
    cap = view.capacity
    total, free = cap.total, cap.free
    by_state = dict(sorted(cap.machines_by_state.items()))
    return {
        "id": view.info.id,
        "region": view.info.region,
        "address": view.info.address,
        "labels": dict(sorted(view.info.labels.items())),
        "status": status_name(view.status),
        "cordoned": cap.cordoned,
        "connected": view.connected,
        "heartbeat_age_s": round(now - view.last_heartbeat, 1) if view.last_heartbeat else None,
        "cpu": _share(total.cpu_millicores - free.cpu_millicores, total.cpu_millicores),
        "memory": _share(total.memory_mib - free.memory_mib, total.memory_mib),
        "disk": _share(total.disk_mib - free.disk_mib, total.disk_mib),
        "machines": {
            "total": sum(n for state, n in by_state.items() if state != "destroyed"),
            "capacity": total.machines,
            "by_state": by_state,
        },
        "images": [
            {"ref": image.ref, "digest": image.digest, "size_bytes": image.size_bytes}
            for image in sorted(cap.images, key=lambda i: i.ref)
        ],
    }


def fleet(views: Iterable[WorkerView], now: float) -> Data:
    """Regions with their sums, then every worker (by region, then id), and the fleet's
    machines by state."""
    workers = sorted((worker(v, now) for v in views), key=lambda w: (w["region"], w["id"]))
    regions: dict[str, Data] = {}
    states: Counter[str] = Counter()
    for w in workers:
        r = regions.setdefault(
            w["region"],
            {"name": w["region"], "workers": 0, "alive": 0, "machines": 0, "by_state": Counter()},
        )
        r["workers"] += 1
        r["alive"] += w["status"] == "alive"
        r["machines"] += w["machines"]["total"]
        r["by_state"].update(w["machines"]["by_state"])
        for part in ("cpu", "memory"):
            mine = w[part]
            sums = r.setdefault(part, {"reserved": 0, "total": 0})
            sums["reserved"] += mine["reserved"]
            sums["total"] += mine["total"]
        states.update(w["machines"]["by_state"])
    for r in regions.values():
        r["by_state"] = dict(sorted(r["by_state"].items()))
        for part in ("cpu", "memory"):
            r[part] = _share(r[part]["reserved"], r[part]["total"])
    return {
        "regions": list(regions.values()),
        "workers": workers,
        "machines_by_state": dict(sorted(states.items())),
    }


# -- an app ------------------------------------------------------------------------------------


def route(info: proxy_pb2.RouteMachine) -> Data:
    """A machine as the proxy routes to it."""
    return {
        "healthy": info.healthy,
        "in_flight": info.in_flight,
        "draining": info.draining,
        "superseded": info.superseded,
        "fenced": info.fenced,
        "generation": info.generation,
    }


def machine_row(
    m: pb.Machine,
    *,
    worker_status: str,
    standbys: Sequence[str] = (),
    routed: proxy_pb2.RouteMachine | None = None,
) -> Data:
    """One machine of an app's table: where it is, its place in its slot (which member serves,
    at which generation), who stands by for it, and the proxy's view of it."""
    slot = slot_of(m)
    return {
        "id": m.id,
        "name": m.name if m.name != m.id else "",
        "state": state_name(m.state),
        "resting": state_name(m.state) in _RESTING,
        "region": m.region,
        "worker": m.worker_id,
        "worker_status": worker_status,
        "role": "primary" if slot.primary == m.id else "standby",
        "slot": slot.id,
        "generation": slot.generation,
        "serving": slot.primary,
        "fenced": slot.fenced,
        "standby_for": list(m.config.standbys),
        "standbys": list(standbys),
        "image": m.config.image,
        "cpu_millicores": m.config.guest.cpu_millicores,
        "memory_mib": m.config.guest.memory_mib,
        "created_at": iso(m.created_at),
        "route": route(routed) if routed is not None else None,
    }


def standbys_of(machines: Iterable[pb.Machine]) -> dict[str, list[str]]:
    """Machine id -> the ids of the machines that stand by for it."""
    out: dict[str, list[str]] = {}
    for m in machines:
        for primary in m.config.standbys:
            out.setdefault(primary, []).append(m.id)
    return out


@dataclass(frozen=True)
class Sample:
    """One app's counts at the proxy at a moment (monotonic seconds)."""

    at: float
    stats: proxy_pb2.AppStats


def percentile(buckets: Sequence[tuple[float, int]], q: float) -> float | None:
    """The upper bound (ms) of the histogram bucket that holds the q-quantile; None for an
    empty one, +inf past the last bound."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    for bound, count in buckets:
        if count >= rank:
            return bound
    return math.inf


def traffic(now: Sample, before: Sample | None) -> Data:
    """Request rate and latency between two samples (since the proxy started without one):
    the latency is a histogram's, so p50 and p99 are bucket bounds ("at most")."""
    cur = now.stats
    old = before.stats if before is not None else proxy_pb2.AppStats()
    seconds = now.at - before.at if before is not None else None
    old_counts = {b.le_ms: b.count for b in old.latency}
    buckets = [(b.le_ms, b.count - old_counts.get(b.le_ms, 0)) for b in cur.latency]
    requests = cur.requests_total - old.requests_total
    statuses = Counter({k: int(v) for k, v in cur.requests_by_status.items()})
    statuses.subtract({k: int(v) for k, v in old.requests_by_status.items()})
    errors = sum(n for code, n in statuses.items() if code.startswith("5"))
    sum_ms = cur.latency_sum_ms - old.latency_sum_ms

    def bound(q: float) -> float | None:
        got = percentile(buckets, q)
        return None if got is None or math.isinf(got) else got

    return {
        "window_s": round(seconds, 1) if seconds is not None else None,
        "requests": requests,
        "rate_per_s": round(requests / seconds, 2) if seconds else None,
        "errors_5xx": errors,
        "by_status": {code: n for code, n in sorted(statuses.items()) if n},
        "latency_ms": {
            "mean": round(sum_ms / requests, 2) if requests else None,
            "p50_at_most": bound(0.5),
            "p99_at_most": bound(0.99),
        },
        "since_proxy_start": before is None,
        "total": cur.requests_total,
    }


def app(
    name: str,
    machines: Sequence[pb.Machine],
    statuses: Mapping[str, str],
    routes: Mapping[str, proxy_pb2.RouteMachine] | None,
    stats: Data | None,
    proxy_error: str = "",
    page: int = 1,
) -> Data:
    """An app's page: its machines (by region, slot, then role: primary, superseded or
    standby), page `page` of them (`PAGE_ROWS` a page; a page past the last has none), the
    proxy's view and traffic, and counts over all its machines. `statuses`: worker id ->
    liveness; `routes`: machine id -> route (None when the proxy could not be asked)."""
    back = standbys_of(machines)

    def order(m: pb.Machine) -> tuple[str, str, bool, str]:
        slot = slot_of(m)
        return (m.region, slot.id, slot.primary != m.id, m.id)

    first = (page - 1) * PAGE_ROWS
    shown = sorted(machines, key=order)[first : first + PAGE_ROWS]  # rows for these only
    rows = [
        machine_row(
            m,
            worker_status=statuses.get(m.worker_id, "unknown"),
            standbys=back.get(m.id, ()),
            routed=None if routes is None else routes.get(m.id),
        )
        for m in shown
    ]
    # A row that still says it serves, though another member's outranks it (its worker, dead
    # or cut off, has not been told yet), is shown superseded, with who serves now.
    best: dict[str, Claim] = {}
    for m in machines:
        slot_id, own = slot_of(m).id, claim(m)
        if slot_id not in best or outranks(own, best[slot_id]):
            best[slot_id] = own
    for r in rows:
        serving = best[r["slot"]][1]
        if r["role"] == "primary" and serving != r["id"]:
            r["role"], r["serving"] = "superseded", serving
    return {
        "app": name,
        "machines": rows,
        "page": {
            "number": page,
            "pages": max(1, math.ceil(len(machines) / PAGE_ROWS)),
            "first": first + 1,
            "rows_per_page": PAGE_ROWS,
            "machines": len(machines),
        },
        "by_state": dict(sorted(Counter(state_name(m.state) for m in machines).items())),
        "routed": None if routes is None else sum(1 for m in machines if m.id in routes),
        "traffic": stats,
        "proxy_error": proxy_error,
    }


# -- a machine ---------------------------------------------------------------------------------


def config(c: pb.MachineConfig) -> Data:
    """A machine's config as JSON, each secret's value shown as `<redacted>` (workers already
    answer so; the console does not rely on it)."""
    kept = pb.MachineConfig()
    kept.CopyFrom(c)
    for name in kept.secrets:
        kept.secrets[name] = REDACTED
    return json_format.MessageToDict(kept, preserving_proto_field_name=True)


def event(e: pb.MachineEvent) -> Data:
    return {
        "seq": e.seq,
        "time": iso(e.time),
        "type": e.type,
        "from": state_name(e.from_state),
        "to": state_name(e.to_state),
        "reason": e.reason,
        "generation": e.generation,
    }


_PARTS = ("cpu", "memory", "image_cached", "spread")


def score_parts(sub_scores: Iterable[Mapping[str, float]]) -> list[str]:
    """The names of the sub-scores present, placement's own first, in its order."""
    present = {k for subs in sub_scores for k in subs}
    return [k for k in _PARTS if k in present] + sorted(present - set(_PARTS))


def placement(d: pb.PlacementDecision | None) -> Data | None:
    """A placement decision, region by region: candidates best first (the winner marked),
    the named rejections, and every rejection counted by reason."""
    if d is None:
        return None
    regions = []
    for r in d.regions:
        parts = score_parts(c.sub_scores for c in r.candidates)
        regions.append(
            {
                "region": r.region,
                "outcome": r.outcome,
                "examined": r.examined,
                "keyed_worker_id": r.keyed_worker_id,
                "parts": parts,
                "candidates": [
                    {
                        "worker_id": c.worker_id,
                        "score": c.score,
                        "sub_scores": dict(c.sub_scores),
                        "chosen": c.worker_id == d.worker_id and r.outcome == "placed",
                    }
                    for c in r.candidates
                ],
                "rejections": [
                    {"worker_id": x.worker_id, "reason": x.reason, "detail": x.detail}
                    for x in r.rejections
                ],
                "rejections_by_reason": dict(
                    sorted(r.rejections_by_reason.items(), key=lambda kv: (-kv[1], kv[0]))
                ),
            }
        )
    return {
        "worker_id": d.worker_id,
        "decided_at": iso(d.decided_at),
        "sample_size": d.sample_size,
        "regions": regions,
    }


def machine(
    m: pb.Machine,
    events: Sequence[pb.MachineEvent],
    decision: pb.PlacementDecision | None,
    logs: Sequence[str],
    *,
    worker_status: str,
    errors: Mapping[str, str] | None = None,
) -> Data:
    """A machine's page: who and where it is, its slot, config (secrets redacted), its event
    history, the last lines of its log, and why it is on its worker."""
    slot = slot_of(m)
    exit_ = m.last_exit
    return {
        "machine": {
            "id": m.id,
            "name": m.name if m.name != m.id else "",
            "app": m.app,
            "state": state_name(m.state),
            "region": m.region,
            "worker": m.worker_id,
            "worker_status": worker_status,
            "instance_id": m.instance_id,
            "created_at": iso(m.created_at),
            "updated_at": iso(m.updated_at),
            "role": "primary" if slot.primary == m.id else "standby",
            "slot": {
                "id": slot.id,
                "generation": slot.generation,
                "serving": slot.primary,
                "fenced": slot.fenced,
            },
            "standby_for": list(m.config.standbys),
            "ports": [
                {"internal": p.internal_port, "host": f"{p.host}:{p.host_port}"} for p in m.ports
            ],
            "restart_count": m.restart_count,
            "last_exit": (
                {
                    "exit_code": exit_.exit_code if exit_.has_exit_code else None,
                    "signal": exit_.signal,
                    "oom_killed": exit_.oom_killed,
                    "at": iso(exit_.exited_at),
                }
                if m.HasField("last_exit")
                else None
            ),
            "lease": (
                {"owner": m.lease.owner, "expires_at": iso(m.lease.expires_at)}
                if m.HasField("lease") and m.lease.owner
                else None
            ),
        },
        "config": config(m.config),
        "events": [event(e) for e in events],
        "placement": placement(decision),
        "logs": list(logs),
        "errors": dict(errors or {}),
    }


# -- the feed of events ------------------------------------------------------------------------

_EXITED = {"stopped": "exited", "failed": "failed"}


def feed_change(change: worker_pb2.MachineChange) -> Data | None:
    """A machine's change as a feed item, or None for a step the feed leaves out (a state it
    only passes through, a lease, a signal)."""
    e, m = change.event, change.machine
    to, was = state_name(e.to_state), state_name(e.from_state)
    if e.type == "promote":
        kind, text = "promoted", e.reason
    elif e.type == "supersede" or e.type == "fence":
        kind, text = ("superseded" if e.type == "supersede" else "fenced"), e.reason
    elif to == was or to not in _RESTING:
        return None
    elif to == "created":
        kind, text = (
            "created",
            f"created on {m.worker_id}"
            + (f", standing by for {', '.join(m.config.standbys)}" if m.config.standbys else ""),
        )
    elif e.type == "exit" and to in _EXITED:
        kind, text = _EXITED[to], e.reason
    else:
        kind, text = to, e.reason
    return {
        "time": iso(e.time),
        "kind": kind,
        "app": m.app,
        "machine_id": m.id,
        "worker_id": m.worker_id,
        "region": m.region,
        "text": text,
        "generation": e.generation,
    }


def feed_placement(e: platform_pb2.PlacementEvent) -> Data:
    """One region's placement decision as a feed item: placed, refused, or a fallback to the
    next region the request named."""
    reasons = ", ".join(
        f"{n} {reason}"
        for reason, n in sorted(e.rejections_by_reason.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    if e.outcome == "placed":
        kind = "placed"
        text = f"placed on {e.worker_id} (score {e.score:.3f}, best of {e.candidates})"
    elif e.outcome == "exhausted":
        kind = "fallback" if e.fallback else "refused"
        text = f"no worker in {e.region} took it" + (f" ({reasons})" if reasons else "")
        text += "; trying the next region" if e.fallback else ""
    else:
        kind, text = "failed", f"a claim in {e.region} failed"
    return {
        "time": iso(e.time),
        "kind": kind,
        "app": e.app,
        "machine_id": e.machine_id,
        "worker_id": e.worker_id,
        "region": e.region,
        "text": text,
        "generation": 0,
    }


def feed_worker(view: WorkerView, what: str, at: Timestamp) -> Data:
    """A worker's change as a feed item: `what` is "joined" (first heard of), its new liveness
    (alive, suspect, dead), "cordoned" or "uncordoned"."""
    text = {
        "joined": f"joined region {view.info.region}",
        "alive": "is alive",
        "suspect": "is late with its heartbeats",
        "dead": "is dead: its heartbeats stopped",
        "unknown": "has not been heard from yet",
        "cordoned": "is cordoned: it takes no new machines",
        "uncordoned": "takes new machines again",
    }[what]
    return {
        "time": iso(at),
        "kind": f"worker_{what}",
        "app": "",
        "machine_id": "",
        "worker_id": view.info.id,
        "region": view.info.region,
        "text": f"worker {view.info.id} {text}",
        "generation": 0,
    }
