"""Where each page's data comes from, and the calls that fetch it.

- the fleet, an app's machines and the feed: the console's own registry replica (it follows
  flaps'), read in memory, so these pages cost no call to anyone;
- a machine's config, event history, log tail and placement decision: its worker, through
  flaps, with the console's read-only token (the SDK, `nonomad.client`);
- health, load, request rate and latency: the proxy's admin API (ListRoutes, GetStats), over
  the cluster's mutual TLS. Rate and latency are the difference between two GetStats samples
  a few seconds apart: the console keeps the last few per app.

A call that fails does not fail the page: the page says what it could not get.

Each request reads through `scoped(scope, flaps)`: the same replica, proxy and samples, seen as
the session's token may see them (`access.Scope`), and flaps called with that token. A page of
an app or a machine the token may not read raises `Hidden` (a 403) before anything is fetched.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import structlog

from flyd.v1 import machine_pb2 as pb
from nonomad.client import ApiError, Client, state_name
from nonomad.console import model
from nonomad.console.access import NOTHING, Scope
from nonomad.console.live import Live
from proxy.v1 import proxy_pb2, proxy_pb2_grpc
from registry.replica import Replica, status_name

__all__ = ["Hidden", "Pages"]

log = structlog.get_logger("console")

RPC_TIMEOUT = 5.0
LOG_TAIL = 100
# Traffic samples kept per app, and for how many apps (the least recently read go first).
SAMPLES_PER_APP = 8
SAMPLED_APPS = 256
# The oldest sample a rate is computed from, and the youngest.
RATE_WINDOW = (1.0, 60.0)
DESTROYED = pb.MACHINE_STATE_DESTROYED
T = TypeVar("T")


class Hidden(Exception):
    """The session's token may not read what the page is of (the message says which caveat)."""


class Pages:
    """The data of every page; see the module docstring. Built with the scope NOTHING: what
    a request reads is `scoped` to its session."""

    def __init__(
        self,
        replica: Replica,
        flaps: Client,
        proxy: proxy_pb2_grpc.ProxyServiceStub | None,
        live: Live,
        *,
        clock: Callable[[], float] = time.monotonic,
        scope: Scope = NOTHING,
    ) -> None:
        self.replica = replica
        self.flaps = flaps
        self.proxy = proxy
        self.live = live
        self.clock = clock
        self.scope = scope
        self._samples: collections.OrderedDict[str, collections.deque[model.Sample]] = (
            collections.OrderedDict()
        )

    def scoped(self, scope: Scope, flaps: Client) -> Pages:
        """These pages as a session sees them: `scope`, and flaps called with its token."""
        other = copy.copy(self)
        other.scope, other.flaps = scope, flaps
        return other

    def check_app(self, app: str) -> None:
        """Hidden unless the session may read `app`."""
        why = self.scope.why_not_app(app)
        if why:
            raise Hidden(why)

    def check_machine(self, app: str, machine_id: str) -> None:
        """Hidden unless the session may read this machine of `app`."""
        self.check_app(app)
        if not self.scope.machine(app, machine_id):
            raise Hidden(f"this token may not read machine {machine_id}")

    # -- the fleet -----------------------------------------------------------------------------

    def statuses(self) -> dict[str, str]:
        """Worker id -> its liveness as the replica judges it."""
        return {v.info.id: status_name(v.status) for v in self.replica.workers()}

    def apps(self) -> list[model.Data]:
        """The apps the session may read, with their machines (those it may read)."""
        scope = self.scope
        out = []
        for name, n in sorted(self.replica.apps().items()):
            if scope.app(name):
                if scope.limits_machines:
                    n = len(self.machines(name, destroyed=True))
                out.append({"name": name, "machines": n})
        return out

    def fleet(self) -> model.Data:
        """Regions, workers and the apps; to a session that may not read the fleet, its apps
        only (and their machines by state)."""
        if self.scope.fleet:
            data = model.fleet(self.replica.workers(), self.replica.clock.now())
        else:
            data = {"regions": [], "workers": [], "machines_by_state": {}}
        data["apps"] = self.apps()
        if not self.scope.fleet:
            states: collections.Counter[str] = collections.Counter()
            for app in data["apps"]:
                states.update(state_name(m.state) for m in self.machines(app["name"]))
            data["machines_by_state"] = dict(sorted(states.items()))
        data["scope"] = self.scope.describe()
        return data

    # -- an app --------------------------------------------------------------------------------

    def machines(self, app: str, *, destroyed: bool = False) -> list[pb.Machine]:
        """The app's machines the session may read (none of an app it may not)."""
        scope = self.scope
        if not scope.app(app):
            return []
        return [
            m
            for m in self.replica.machines(app=app)
            if (destroyed or m.state != DESTROYED)
            and (not scope.limits_machines or scope.machine(app, m.id))
        ]

    async def routes(self, app: str) -> tuple[dict[str, proxy_pb2.RouteMachine] | None, str]:
        """The app's machines as the proxy routes them, by id; None and why when it cannot
        say."""
        if self.proxy is None:
            return None, "no proxy configured"
        try:
            resp = await self.proxy.ListRoutes(
                proxy_pb2.ListRoutesRequest(app=app), timeout=RPC_TIMEOUT
            )
        except grpc.aio.AioRpcError as err:
            return None, f"the proxy did not answer: {err.code().name}: {err.details()}"
        return {m.machine_id: m for a in resp.apps for m in a.machines}, ""

    async def traffic(self, app: str) -> model.Data | None:
        """Request rate and latency at the proxy since an earlier sample of this app (since the
        proxy started, the first time); None when the proxy cannot say."""
        if self.proxy is None:
            return None
        try:
            resp = await self.proxy.GetStats(
                proxy_pb2.GetStatsRequest(app=app), timeout=RPC_TIMEOUT
            )
        except grpc.aio.AioRpcError:
            return None
        stats = resp.apps[0] if resp.apps else proxy_pb2.AppStats(app=app)
        now = model.Sample(self.clock(), stats)
        kept = self._samples.pop(app, None) or collections.deque(maxlen=SAMPLES_PER_APP)
        self._samples[app] = kept
        while len(self._samples) > SAMPLED_APPS:
            self._samples.popitem(last=False)
        low, high = RATE_WINDOW
        before = next((s for s in kept if low <= now.at - s.at <= high), None)
        if not kept or now.at - kept[-1].at >= low:
            kept.append(now)
        return model.traffic(now, before)

    async def app(self, name: str, *, destroyed: bool = False, page: int = 1) -> model.Data:
        self.check_app(name)
        (routes, error), traffic = await asyncio.gather(self.routes(name), self.traffic(name))
        machines = self.machines(name, destroyed=destroyed)
        return model.app(name, machines, self.statuses(), routes, traffic, error, page)

    # -- a machine -----------------------------------------------------------------------------

    async def machine(self, machine_id: str) -> model.Data:
        """The machine as its worker has it, its events, log tail and placement decision.
        NotFound when no worker has it; a part that fails is named in `errors`."""
        known = self.replica.machine(machine_id)
        if known is not None:
            self.check_machine(known.app, machine_id)
        machine = await self.flaps.get_machine(machine_id, timeout=RPC_TIMEOUT)
        self.check_machine(machine.app, machine_id)
        errors: dict[str, str] = {}

        async def part(name: str, call: Awaitable[T]) -> T | None:
            try:
                return await call
            except ApiError as err:
                errors[name] = str(err)
                return None

        async def logs() -> list[str]:
            lines = self.flaps.machine_logs(machine_id, tail_lines=LOG_TAIL, timeout=RPC_TIMEOUT)
            return [line async for line in lines]

        flaps = self.flaps
        events, decision, tail = await asyncio.gather(
            part("events", flaps.list_machine_events(machine_id, timeout=RPC_TIMEOUT)),
            part("placement", flaps.get_placement(machine_id, timeout=RPC_TIMEOUT)),
            part("logs", logs()),
        )
        return model.machine(
            machine,
            events if events is not None else list(machine.events),
            decision,
            tail or [],
            worker_status=self.statuses().get(machine.worker_id, "unknown"),
            errors=errors,
        )

    def machine_row(self, machine_id: str) -> model.Data | None:
        """The machine's summary from the replica's row (no call): for live updates."""
        row = self.replica.machine(machine_id)
        if row is None or not self.scope.machine(row.app, row.id):
            return None
        status = self.statuses().get(row.worker_id, "unknown")
        return model.machine(row, [], None, [], worker_status=status)["machine"]

    # -- the feed ------------------------------------------------------------------------------

    def events(self, *, app: str = "", after: int = 0) -> model.Data:
        items = [
            i for i in self.live.items(after) if (not app or i["app"] == app) and self.scope.item(i)
        ]
        return {
            "events": items[::-1],
            "last_seq": self.live.last_seq,
            "placements_watched": self.live.placements_watched.is_set(),
        }
