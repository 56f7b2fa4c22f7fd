"""The Machines API and the Platform API: the exchange.

flaps keeps no state of its own. A create is a bid that placement turns into a ranked list of
workers; flaps claims on the first, and the worker's answer is final: on a refusal it tries
the next, and when nothing in the named regions can take the machine it fails at once. Every
other call goes straight to the worker that owns the machine, found from the machine id
(`<worker id>-<12 hex>`), so a machine just created can be read at once, from any flaps.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import hashlib
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import structlog
from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2
from opentelemetry import trace

from flaps import auth, explain, metrics, placement
from flaps.auth import REASON_DOMAIN, current_grant
from flaps.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KeyInDoubt,
    NoCapacity,
    NotFound,
    Unavailable,
    Upstream,
)
from flaps.images import ImageOwners
from flaps.v1 import machines_pb2 as m
from flaps.v1 import machines_pb2_grpc, platform_pb2, platform_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model import slots
from model.errors import DOMAIN as FLYD_DOMAIN
from model.errors import REFUSED_NOW
from model.pages import checked_page_size
from model.validate import CONFIG_LIMITS, EGRESS_LABEL, REDACTED, check_config, guest_disk_mib
from registry.replica import Replica
from registry.rows import MachineQuery
from registry.supply import Pool
from registry.v1 import registry_pb2
from registry.view import ALIVE, Doubt
from runtime import ChannelTLS, abort_with_details, aio_channel, error_info, time_left
from runtime.clock import SYSTEM_CLOCK, Clock
from runtime.entropy import SYSTEM, Entropy
from runtime.limits import DEFAULT_LIMITS, Limits
from runtime.streams import CallerCaps, caller_name
from runtime.validate import check_name, duration_seconds, quote

log = structlog.get_logger("flaps")
S = pb.MachineState
STATUS_NAMES = {
    registry_pb2.MEMBER_STATUS_ALIVE: "alive",
    registry_pb2.MEMBER_STATUS_SUSPECT: "suspect",
    registry_pb2.MEMBER_STATUS_DEAD: "dead",
}
# How long a claim on a worker may take before flaps gives up on that worker.
CLAIM_TIMEOUT = 10.0
# A create under an idempotency key (see `MachinesServicer._settle_doubts`): a worker's
# heartbeat vouches for the keys it holds and is making as of its own time, and counts when
# sent at most VOUCH_MARGIN before (flaps --key-vouch-margin: more than the workers' heartbeat
# interval plus the clocks' skew and the transit); a keyed claim's not_after is as much before
# flaps gives up on the claim. A worker silent for longer
# than KEY_DOUBT (flaps --key-doubt) is no longer waited for; at most MAX_PROBES silent ones
# are asked at once, each for at most PROBE_TIMEOUT.
VOUCH_MARGIN = 1.0
KEY_DOUBT = 30.0
PLACED_KEPT = 10_000
PROBE_TIMEOUT = 2.0
MAX_PROBES = 32
RPC_TIMEOUT = 10.0
MAX_WAIT = 60.0
MAX_LEASE = 3600.0
# Workers per page of ListWorkers: by default, and at most.
PAGE_SIZE = 500
MAX_PAGE_SIZE = 5000
LIMITS = DEFAULT_LIMITS.merged(
    CONFIG_LIMITS,
    Limits(
        texts={
            "flaps.v1.AcquireLeaseRequest.owner": 256,
            "flaps.v1.CreateMachineRequest.name": 63,
            "flaps.v1.CreateMachineRequest.idempotency_key": 256,
            "flaps.v1.StopMachineRequest.signal": 16,
            "flaps.v1.RestartMachineRequest.signal": 16,
            "flaps.v1.SignalMachineRequest.signal": 16,
        },
        counts={
            "flaps.v1.CreateMachineRequest.regions": 16,
            "flaps.v1.CreateMachineRequest.standby_for": 16,
            "flaps.v1.SimulatePlacementRequest.regions": 16,
            "flaps.v1.SimulatePlacementRequest.standby_for": 16,
        },
    ),
)
"""The bounds of MachinesService and PlatformService requests (`runtime.limits`)."""
# Worker answers that mean "not here, try another": nothing was created.
REFUSALS: dict[grpc.StatusCode, metrics.Claim] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: "refused",
    grpc.StatusCode.UNAVAILABLE: "unreachable",
}
# A claim that ended so may have created the machine on the worker all the same.
_GAVE_UP = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# A worker's answers after which it surely made nothing (any other end of a claim may have
# made the machine: the call may have been carried out before its connection broke).
_FINAL = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def made_nothing(err: grpc.aio.AioRpcError) -> bool:
    """Whether a failed call surely did nothing on the worker: a final answer of its own
    (UNAVAILABLE only when flyd says so, model.errors.REFUSED_NOW), or a connection that was
    never made (the call was never sent)."""
    code = err.code()
    if code in _FINAL:
        return True
    if code != grpc.StatusCode.UNAVAILABLE:
        return False
    info = error_info(err)
    if info is not None and info.domain == FLYD_DOMAIN and info.reason == REFUSED_NOW:
        return True
    details = (err.details() or "").lower()
    return "connection refused" in details or "failed to connect" in details


def machine_suffix(app: str, idempotency_key: str, entropy: Entropy = SYSTEM) -> str:
    """The machine id's tail: derived from the key, so every retry names the same machine
    (random, from `entropy`, without one)."""
    if not idempotency_key:
        return entropy.token_hex(6)
    return hashlib.sha256(f"{app}\0{idempotency_key}".encode()).hexdigest()[:12]


class Workers:
    """gRPC channels to workers, one per address, opened on first use (with `tls`, the
    cluster's mutual TLS: workers serve only the cluster's certificates)."""

    def __init__(self, replica: Replica, tls: ChannelTLS | None = None) -> None:
        self.replica = replica
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerServiceStub] = {}

    def stub(self, worker_id: str) -> worker_pb2_grpc.WorkerServiceStub:
        view = self.replica.worker(worker_id)
        if view is None:
            raise Unavailable(f"worker {worker_id} is not known to this flaps")
        address = view.info.address
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._channels[address] = aio_channel(address, tls=self.tls)
            stub = self._stubs[address] = worker_pb2_grpc.WorkerServiceStub(channel)
        return stub

    def owner(self, machine_id: str) -> str:
        """The worker that owns a machine: named in its id, or known to the registry."""
        if not machine_id:
            raise InvalidArgument("machine_id", "is required")
        prefix = machine_id.rpartition("-")[0]
        if prefix and self.replica.worker(prefix) is not None:
            return prefix
        machine = self.replica.machine(machine_id)
        if machine is not None:
            return machine.worker_id
        check_name("machine_id", machine_id)
        raise NotFound(f"machine {machine_id} not found")

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


def _conclude(
    decision: placement.Decision, outcome: metrics.Outcome, winner: str | None = None
) -> None:
    """A region's decision is final: count it, and put it on the current span as the event
    `placement.decision` (a cheap no-op when tracing is off)."""
    metrics.concluded(decision, outcome)
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.add_event(
        "placement.decision",
        {
            "region": decision.region,
            "outcome": outcome,
            "winner": winner or "",
            "examined": decision.examined,
            "rejections_by_reason": [f"{k}={n}" for k, n in sorted(decision.counts().items())],
            "candidates": [f"{c.worker_id}={c.score}" for c in decision.candidates],
            "sub_scores": [
                f"{c.worker_id}:" + ",".join(f"{k}={v:.3f}" for k, v in c.sub_scores.items())
                for c in decision.candidates
            ],
            "rejections": [f"{r.worker_id}:{r.reason}" for r in decision.rejections],
            "rejection_details": [f"{r.worker_id}:{r.detail}" for r in decision.rejections],
        },
    )


class Exchange:
    """What both services share: the replica view, worker channels, the placement settings,
    and what flaps can tell of images' owners (None: only the workers check them)."""

    def __init__(
        self,
        replica: Replica,
        workers: Workers,
        pipeline: placement.Pipeline,
        images: ImageOwners | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        entropy: Entropy = SYSTEM,
        key_doubt: float = KEY_DOUBT,
        vouch_margin: float = VOUCH_MARGIN,
    ) -> None:
        """`clock` stamps placement decisions; `entropy` names the machines created without an
        idempotency key (a simulated flaps' are seeded: runtime.entropy); `key_doubt`: how
        long a create under a key waits for a silent worker that may hold it; `vouch_margin`:
        how old a worker's last heartbeat may be and still vouch for the keys it holds (see
        `MachinesServicer._settle_doubts`)."""
        self.replica = replica
        self.workers = workers
        self.pipeline = pipeline
        self.images = images
        self.clock = clock
        self.entropy = entropy
        self.key_doubt = key_doubt
        self.vouch_margin = vouch_margin
        self.watchers = explain.Watchers(clock=clock)
        # Creates under one key through this flaps go one at a time.
        self._keys: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}
        # The keys this flaps placed whose rows its replica may not have yet: key -> id.
        self._placed: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()

    def remember_placed(self, app: str, key: str, machine_id: str) -> None:
        """A machine was placed under the app's key: until the replica has its row, `placed`
        names it (at most PLACED_KEPT keys, the oldest forgotten first)."""
        self._placed[(app, key)] = machine_id
        self._placed.move_to_end((app, key))
        while len(self._placed) > PLACED_KEPT:
            self._placed.popitem(last=False)

    def placed(self, app: str, key: str) -> str | None:
        """The machine this flaps placed under the key, while its replica has no row of it."""
        machine_id = self._placed.get((app, key))
        if machine_id is not None and self.replica.row(machine_id) is not None:
            del self._placed[(app, key)]  # the replica has it: by_key finds it from now on
            return None
        return machine_id

    def forget_placed(self, app: str, key: str) -> None:
        self._placed.pop((app, key), None)

    @contextlib.asynccontextmanager
    async def one_at_a_time(self, app: str, key: str) -> AsyncIterator[None]:
        """Hold the app's idempotency key: another create under it through this flaps waits
        (and then finds what this one made). The locks go with their last holder."""
        lock, users = self._keys.get((app, key), (asyncio.Lock(), 0))
        self._keys[(app, key)] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._keys[(app, key)]
            if users == 1:
                del self._keys[(app, key)]
            else:
                self._keys[(app, key)] = (lock, users - 1)

    async def check_image(
        self, config: pb.MachineConfig, *, app: str = "", machine_id: str = ""
    ) -> None:
        """Refuse (ImageDenied, before any worker is asked) a config whose image a machine of
        `app` (or of the app of `machine_id`) may not run, when flaps can tell (flaps.images);
        the worker checks it again."""
        if self.images is not None:
            await self.images.check(app or await self.app_of(machine_id), config.image)

    async def app_of(self, machine_id: str) -> str:
        """The app a machine belongs to: from the registry view, else (a machine just made,
        which the view has not seen yet) from its worker. NotFound when there is none."""
        row = self.replica.row(machine_id)  # (its app, without parsing the machine)
        if row is not None:
            return row.app
        stub = self.workers.stub(self.workers.owner(machine_id))
        try:
            got = await stub.GetMachine(
                w.GetMachineRequest(machine_id=machine_id), timeout=RPC_TIMEOUT
            )
        except grpc.aio.AioRpcError as err:
            raise Upstream(err) from None
        return got.machine.app

    def regions_of(self, region: str, regions: Iterable[str], field: str = "region") -> list[str]:
        wanted: list[str] = []
        for i, name in enumerate([region, *regions] if region else list(regions)):
            where = field if (region and i == 0) else f"regions[{i - (1 if region else 0)}]"
            check_name(where, name)
            if name not in self.replica.regions():
                known = ", ".join(sorted(self.replica.regions())) or "none"
                raise InvalidArgument(where, f"unknown region {quote(name)} (known: {known})")
            if name not in wanted:
                wanted.append(name)
        if not wanted:
            raise InvalidArgument(field, "a region (or regions) is required")
        return wanted

    def request(
        self,
        app: str,
        regions: list[str],
        config: pb.MachineConfig,
        standby_for: Iterable[str],
        seed: str | None,
    ) -> placement.Request:
        wanted = config.placement
        if config.network.egress:  # only a worker that can let it out
            wanted = pb.PlacementConfig()
            wanted.CopyFrom(config.placement)
            wanted.required_labels[EGRESS_LABEL] = "true"
        guest = pb.GuestConfig()
        guest.CopyFrom(config.guest)
        guest.disk_mib = guest_disk_mib(guest)  # what the worker reserves for 0
        return placement.Request(
            app=app,
            regions=tuple(regions),
            guest=guest,
            image=config.image,
            placement=wanted,
            standby_for=frozenset(standby_for),
            seed=seed,
            primaries=self.primaries(standby_for),
        )

    def primaries(self, standby_for: Iterable[str]) -> dict[str, str]:
        """Worker id -> a primary it holds (not destroyed), for each primary named."""
        out: dict[str, str] = {}
        for primary in standby_for:
            row = self.replica.row(primary)
            owner = self.replica.owner(primary)
            if row is not None and owner is not None and row.state != S.MACHINE_STATE_DESTROYED:
                out.setdefault(owner, primary)
        return out


STREAMS_PER_CALLER = 32
"""Default of flaps --streams-per-caller: followed logs and waits one token (or cluster part)
may have open at once, each kind counted apart."""


def _caller(context: grpc.aio.ServicerContext) -> str:
    """Who a per-caller cap counts: the token's id, else the certificate's name or host."""
    grant = current_grant()
    return f"token {grant.token_id}" if grant is not None else caller_name(context)


class MachinesServicer(machines_pb2_grpc.MachinesServiceServicer):
    """flaps.v1.MachinesService."""

    def __init__(self, exchange: Exchange, *, streams_per_caller: int = STREAMS_PER_CALLER) -> None:
        self.x = exchange
        self._rollbacks: set[asyncio.Task[None]] = set()
        # Every object a call names is of its app (model.scope), on every path to a handler.
        auth.scoped(self, m.DESCRIPTOR.services_by_name["MachinesService"], exchange.app_of)
        self.streams = CallerCaps(
            limit=streams_per_caller, setting="--streams-per-caller", domain=REASON_DOMAIN
        )

    async def _call(
        self, machine_id: str, rpc: str, request: object, timeout: float = RPC_TIMEOUT
    ) -> object:
        worker_id = self.x.workers.owner(machine_id)
        stub = self.x.workers.stub(worker_id)
        try:
            # The worker gets no more time than our caller has left.
            return await getattr(stub, rpc)(request, timeout=time_left(timeout))
        except grpc.aio.AioRpcError as err:
            raise Upstream(err) from None

    async def CreateMachine(
        self, request: m.CreateMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.CreateMachineResponse:
        if not request.idempotency_key:
            return await self._create(request, context)
        check_name("app", request.app)
        async with self.x.one_at_a_time(request.app, request.idempotency_key):
            return await self._create(request, context)

    async def _create(
        self, request: m.CreateMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.CreateMachineResponse:
        check_name("app", request.app)
        if len(request.name) > 63:
            raise InvalidArgument("name", "must be at most 63 characters")
        regions = self.x.regions_of(request.region, request.regions)
        check_config(request.config)
        await self.x.check_image(request.config, app=request.app)
        lease_ttl = duration_seconds(
            "lease_ttl",
            request.lease_ttl,
            default=0,
            maximum=MAX_LEASE,
            present=request.HasField("lease_ttl"),
        )
        suffix = machine_suffix(request.app, request.idempotency_key, self.x.entropy)
        if request.idempotency_key:
            existing = await self._existing(request.app, request.idempotency_key)
            if existing is None:
                existing = await self._settle_doubts(
                    request.app, request.idempotency_key, suffix, regions
                )
            if existing is not None:
                return m.CreateMachineResponse(machine=existing)
        config = pb.MachineConfig()
        config.CopyFrom(request.config)
        skip_launch = request.skip_launch
        # Each primary is a machine of the app (flaps.auth.check_scope ran before this).
        for primary in request.standby_for:
            if primary not in config.standbys:
                config.standbys.append(primary)
            skip_launch = True  # a standby waits, stopped, for its primary's worker to die
        if request.secrets_from:
            await self._inherit_secrets(request.app, request.secrets_from, config)
        bid = self.x.request(
            request.app, regions, config, request.standby_for, request.idempotency_key or None
        )
        counts: Counter[str] = Counter()
        tried: list[pb.RegionPlacement] = []  # the regions exhausted, for the worker to keep
        for i, region in enumerate(regions):
            if i:
                metrics.fell_back("next_region")
            decision = self.x.pipeline.decide(self.x.replica.supply, bid, region)
            try:
                placed = await self._claim_best(
                    decision, suffix, request, config, skip_launch, tried
                )
            except Upstream:
                self._conclude(request.app, decision, "failed")
                raise
            if placed is None:
                self._conclude(request.app, decision, "exhausted", fallback=i + 1 < len(regions))
                tried.append(explain.region_record(decision, "exhausted"))
                counts.update(decision.counts())
                continue
            machine, candidate = placed
            self._conclude(request.app, decision, "placed", candidate, machine.id)
            log.info(
                "placed",
                machine_id=machine.id,
                worker=candidate.worker_id,
                region=region,
                score=candidate.score,
                state="created",
            )
            response = m.CreateMachineResponse(machine=machine)
            if request.idempotency_key:
                self.x.remember_placed(request.app, request.idempotency_key, machine.id)
            try:
                if lease_ttl:
                    lease = await self._call(
                        machine.id,
                        "AcquireLease",
                        w.AcquireLeaseRequest(
                            machine_id=machine.id, ttl=request.lease_ttl, owner="flaps create"
                        ),
                    )
                    assert isinstance(lease, w.AcquireLeaseResponse)
                    response.lease.CopyFrom(lease.lease)
                if time_left(1.0) <= 0:
                    raise DeadlineExceeded(f"machine {machine.id} was placed too late")
            except BaseException:
                # The caller will not learn of the machine (its deadline passed, it left, or
                # the lease failed): without a key no retry can find it, so it goes.
                if not request.idempotency_key:
                    self._roll_back(machine.id)
                raise
            return response
        error = NoCapacity(regions, counts)
        log.info("no_capacity", app=request.app, regions=regions, rejections=dict(counts))
        await abort_with_details(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            str(error),
            error_details_pb2.ErrorInfo(
                reason="NO_CAPACITY",
                domain="flaps.nonomad",
                metadata={reason: str(n) for reason, n in counts.items()},
            ),
            error_details_pb2.QuotaFailure(
                violations=[
                    error_details_pb2.QuotaFailure.Violation(subject=reason, description=f"{n}")
                    for reason, n in counts.most_common()
                ]
            ),
        )
        raise AssertionError("abort returns only by raising")

    def _conclude(
        self,
        app: str,
        decision: placement.Decision,
        outcome: metrics.Outcome,
        winner: placement.Candidate | None = None,
        machine_id: str = "",
        *,
        fallback: bool = False,
    ) -> None:
        """A region's decision is final: counted, on the span, and told to the watchers."""
        _conclude(decision, outcome, winner.worker_id if winner is not None else None)
        self.x.watchers.publish(
            app, decision, outcome, winner=winner, machine_id=machine_id, fallback=fallback
        )

    async def _inherit_secrets(self, app: str, source: str, config: pb.MachineConfig) -> None:
        """Give `config` the secrets of machine `source` (of `app`: flaps.auth.check_scope)
        that it does not set, or sets to REDACTED: the values come from the source's worker,
        over mTLS, to go straight to the new machine's worker, which seals them with its own
        key."""
        try:
            opened = await self._call(
                source, "RevealSecrets", w.RevealSecretsRequest(machine_id=source)
            )
        except (NotFound, Upstream) as err:
            if isinstance(err, Upstream) and err.code != grpc.StatusCode.NOT_FOUND:
                raise
            raise InvalidArgument("secrets_from", f"machine {source} not found") from None
        assert isinstance(opened, w.RevealSecretsResponse)
        for name, value in opened.secrets.items():
            if config.secrets.get(name, REDACTED) == REDACTED:
                config.secrets[name] = value
        for name, value in config.secrets.items():
            if value == REDACTED:
                raise InvalidArgument(
                    f"config.secrets[{name}]",
                    f"{REDACTED} takes machine {source}'s value, and it has no {name}",
                )

    def _roll_back(self, machine_id: str) -> None:
        """Destroy a machine just created for a caller who will never hear of it, in the
        background (in a context of its own: not bound by the caller's deadline)."""

        async def destroy() -> None:
            try:
                await self._call(
                    machine_id,
                    "DestroyMachine",
                    w.DestroyMachineRequest(machine_id=machine_id, force=True),
                )
                log.info("create_rolled_back", machine_id=machine_id, state="destroying")
            except Exception as err:  # reported; the machine stays, as an orphan would
                log.warning("create_roll_back_failed", machine_id=machine_id, error=str(err))

        task = asyncio.create_task(destroy(), context=contextvars.Context())
        self._rollbacks.add(task)
        task.add_done_callback(self._rollbacks.discard)

    async def _claim_best(
        self,
        decision: placement.Decision,
        suffix: str,
        request: m.CreateMachineRequest,
        config: pb.MachineConfig,
        skip_launch: bool,
        tried: list[pb.RegionPlacement],
    ) -> tuple[pb.Machine, placement.Candidate] | None:
        """Claim on the candidates in rank order; the first that takes it, or None. `tried`:
        the regions exhausted before this one (the worker keeps them with the decision)."""
        for i, candidate in enumerate(decision.candidates):
            if i:
                metrics.fell_back("next_worker")
            why = explain.record(
                tried, decision, candidate, self.x.pipeline.sample_size, self.x.clock.now()
            )
            machine = await self._claim(
                candidate, suffix, request, config, skip_launch, decision, why
            )
            if machine is not None:
                return machine, candidate
        return None

    async def _claim(
        self,
        candidate: placement.Candidate,
        suffix: str,
        request: m.CreateMachineRequest,
        config: pb.MachineConfig,
        skip_launch: bool,
        decision: placement.Decision,
        why: pb.PlacementDecision,
    ) -> pb.Machine | None:
        """Claim on one worker: its machine, or None when it refused (recorded). `why` goes
        with the claim: the worker keeps it with the machine."""
        machine_id = f"{candidate.worker_id}-{suffix}"
        # No more than our caller has left: the worker does not commit a machine it could
        # not answer for in time.
        timeout = time_left(CLAIM_TIMEOUT)
        claim = w.CreateMachineRequest(
            machine_id=machine_id,
            name=request.name,
            app=request.app,
            config=config,
            skip_launch=skip_launch,
            idempotency_key=request.idempotency_key,
            placement=why,
        )
        not_after = 0.0
        if request.idempotency_key:
            # Arriving later, the claim makes nothing: held up in the network, it cannot make
            # the key's machine after a retry found no worker holding it.
            margin = self.x.vouch_margin
            if timeout <= margin:
                raise DeadlineExceeded(
                    f"too little time left ({timeout:.2f}s) to claim a machine under a key"
                )
            not_after = self.x.clock.now() + timeout - margin
            claim.not_after.FromNanoseconds(int(not_after * 1e9))
        try:
            stub = self.x.workers.stub(candidate.worker_id)
            resp = await stub.CreateMachine(claim, timeout=timeout)
        except asyncio.CancelledError:
            # Our caller is gone (its deadline, a cancel) while the worker may be committing
            # the machine: without a key no retry could find it, so it must not stay.
            if not request.idempotency_key:
                self._roll_back(machine_id)
            raise
        except grpc.aio.AioRpcError as err:
            reason = REFUSALS.get(err.code())
            if request.idempotency_key and not made_nothing(err):
                # It may have made the key's machine. Trying elsewhere could make a second:
                # the caller hears of the failure once the claim can no longer arrive (its
                # not_after), so that its retry finds the machine, or the worker in doubt.
                await self.x.clock.sleep_until(not_after + self.x.vouch_margin)
                metrics.claimed("failed")
                raise Upstream(err) from None
            if reason is None:
                # Anything else is final: a timeout may have created the machine, and trying
                # elsewhere could create it twice. A retry with the same key is safe; without
                # a key, what a timeout may have created goes.
                if err.code() in _GAVE_UP and not request.idempotency_key:
                    self._roll_back(machine_id)
                metrics.claimed("failed")
                raise Upstream(err) from None
            metrics.claimed(reason)
            decision.rejections.append(
                placement.Rejection(candidate.worker_id, reason, err.details() or "")
            )
            return None
        except Unavailable as err:
            metrics.claimed("unreachable")
            decision.rejections.append(
                placement.Rejection(candidate.worker_id, "unreachable", str(err))
            )
            return None
        metrics.claimed("accepted")
        return resp.machine

    async def _settle_doubts(
        self, app: str, key: str, suffix: str, regions: list[str]
    ) -> pb.Machine | None:
        """Before a key is placed: the key's machine, if a worker of its regions holds it
        although the view has no row of it; None when none does (it may be placed).

        A worker whose last heartbeat is recent vouches for itself: its rows came before it,
        and it lists the keyed creates it is making (then: KeyInDoubt, retry). One silent
        since is asked (GetMachine of the id the key has there): the machine, NOT_FOUND, or
        KeyInDoubt when it cannot say. One silent for longer than `key_doubt` is no longer
        waited for: it may hold the key's machine unseen (a partition that outlasts it), and
        is logged. A claim that reaches a worker after its not_after makes nothing, so what
        a worker holds is settled by then.
        """
        doubts, expired = self.x.replica.key_doubts(
            regions, suffix, margin=self.x.vouch_margin, give_up_after=self.x.key_doubt
        )
        for d in expired:
            log.debug(
                "key_doubt_given_up",
                app=app,
                key=key,
                worker=d.worker_id,
                silent_for=round(d.silent_for, 1),
            )
        for d in doubts:
            if d.creating:
                machine_id = f"{d.worker_id}-{suffix}"
                raise KeyInDoubt(
                    d.worker_id,
                    machine_id,
                    f"a create under key {quote(key)} is under way on worker {d.worker_id} "
                    f"(machine {machine_id}): retry",
                )
        if len(doubts) > MAX_PROBES:
            d = doubts[0]
            raise KeyInDoubt(
                d.worker_id,
                f"{d.worker_id}-{suffix}",
                f"{len(doubts)} workers of {', '.join(regions)} were not heard from lately "
                f"(more than {MAX_PROBES} to ask), and any may hold the machine of key "
                f"{quote(key)}: retry",
            )
        found = await asyncio.gather(*(self._probe(d, app, key, suffix) for d in doubts))
        return next((machine for machine in found if machine is not None), None)

    async def _probe(self, doubt: Doubt, app: str, key: str, suffix: str) -> pb.Machine | None:
        """Ask a silent worker for the machine a key has there (see `_settle_doubts`)."""
        machine_id = f"{doubt.worker_id}-{suffix}"
        why = ""
        try:
            stub = self.x.workers.stub(doubt.worker_id)
            got = await stub.GetMachine(
                w.GetMachineRequest(machine_id=machine_id), timeout=time_left(PROBE_TIMEOUT)
            )
        except Unavailable as err:
            why = str(err)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            why = f"{err.code().name}: {err.details()}"
        else:
            machine = got.machine
            held = machine.app == app and machine.idempotency_key == key
            return machine if held else None
        raise KeyInDoubt(
            doubt.worker_id,
            machine_id,
            f"worker {doubt.worker_id} was not heard from for {doubt.silent_for:.1f}s and may "
            f"hold the machine of key {quote(key)} ({machine_id}), but cannot say ({why}): "
            f"retry (a worker silent for {self.x.key_doubt:g}s is no longer waited for)",
        )

    async def _existing(self, app: str, key: str) -> pb.Machine | None:
        """The machine a key of the app created, as its worker has it now; None if none.

        Found in the replica, or, until the replica has its row, among the keys this flaps
        placed lately (`Exchange.placed`): a worker that froze right after it answered streams
        the row late, and a create under the key meanwhile must not place it again."""
        machine = self.x.replica.by_key(app, key)
        machine_id = machine.id if machine is not None else self.x.placed(app, key)
        if machine_id is None:
            return None
        try:
            got = await self._call(
                machine_id, "GetMachine", w.GetMachineRequest(machine_id=machine_id)
            )
        except Upstream as err:
            if err.code == grpc.StatusCode.NOT_FOUND:
                # Its worker dropped it (a create rolled back once its caller was gone): the
                # replica's row is the last one it streamed, but the key holds nothing now.
                self.x.forget_placed(app, key)
                return None
            raise
        assert isinstance(got, w.GetMachineResponse)
        return got.machine

    async def _forward(self, rpc: str, request: Any, *, timeout: float = RPC_TIMEOUT) -> Any:
        """Send a call on a machine to its worker, field by field name, and return the worker's
        answer as flaps' response (the two APIs' responses share their layout)."""
        worker_request = getattr(w, f"{rpc}Request")()
        json_format.ParseDict(
            json_format.MessageToDict(request, preserving_proto_field_name=True),
            worker_request,
            ignore_unknown_fields=True,  # e.g. flaps-only fields; the worker has the rest
        )
        answer = await self._call(request.machine_id, rpc, worker_request, timeout=timeout)
        response = getattr(m, f"{rpc}Response")()
        response.MergeFromString(answer.SerializeToString())  # type: ignore[attr-defined]
        return response

    async def GetMachine(
        self, request: m.GetMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.GetMachineResponse:
        return await self._forward("GetMachine", request)

    async def ListMachines(
        self, request: m.ListMachinesRequest, context: grpc.aio.ServicerContext
    ) -> m.ListMachinesResponse:
        check_name("app", request.app, required=False)
        if request.region:
            self.x.regions_of(request.region, [])
        size = checked_page_size(request.page_size)
        grant = current_grant()  # a token's caller sees only the machines it may read
        wanted = request.state
        destroyed = request.include_destroyed or wanted == S.MACHINE_STATE_DESTROYED

        def keep(machine_id: str, app: str, state: int) -> bool:
            return (
                (not wanted or state == wanted)
                and (destroyed or state != S.MACHINE_STATE_DESTROYED)
                and (grant is None or grant.may("read", app, machine_id))
            )

        # Only the page is read (and parsed), whatever the app holds.
        listed, next_token = self.x.replica.machine_page(
            MachineQuery(
                request.app or None, request.region or None, request.page_token, size, keep
            )
        )
        return m.ListMachinesResponse(machines=listed, next_page_token=next_token)

    async def UpdateMachine(
        self, request: m.UpdateMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.UpdateMachineResponse:
        check_config(request.config)
        await self.x.check_image(request.config, machine_id=request.machine_id)
        # Replacing a running machine stops it first: allow for its stop timeout.
        return await self._forward("UpdateMachine", request, timeout=CLAIM_TIMEOUT + 30)

    async def StartMachine(
        self, request: m.StartMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.StartMachineResponse:
        if not request.generation:
            known = self.x.replica.machine(request.machine_id)
            if known is not None and not slots.is_primary(known):
                # Starting a standby is promoting it: at its own next generation (model.slots).
                members = self.x.replica.machines(app=known.app)
                request.generation = slots.promotion_generation(known, members)
        return await self._forward("StartMachine", request)

    async def SupersedeMachine(
        self, request: m.SupersedeMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.SupersedeMachineResponse:
        # The worker holds only its own rows: it is told the primary's app, and refuses one of
        # another app than the machine's (flaps.auth.check_scope refused it here already).
        told = w.SupersedeMachineRequest(
            machine_id=request.machine_id,
            generation=request.generation,
            primary=request.primary,
            primary_app=await self.x.app_of(request.primary),
        )
        answer = await self._call(request.machine_id, "SupersedeMachine", told)
        assert isinstance(answer, w.SupersedeMachineResponse)
        return m.SupersedeMachineResponse(machine=answer.machine)

    async def StopMachine(
        self, request: m.StopMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.StopMachineResponse:
        return await self._forward("StopMachine", request)

    async def RestartMachine(
        self, request: m.RestartMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.RestartMachineResponse:
        return await self._forward("RestartMachine", request)

    async def SignalMachine(
        self, request: m.SignalMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.SignalMachineResponse:
        return await self._forward("SignalMachine", request)

    async def DestroyMachine(
        self, request: m.DestroyMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.DestroyMachineResponse:
        return await self._forward("DestroyMachine", request)

    async def WaitMachine(
        self, request: m.WaitMachineRequest, context: grpc.aio.ServicerContext
    ) -> m.WaitMachineResponse:
        timeout = duration_seconds(
            "timeout",
            request.timeout,
            default=30.0,
            maximum=MAX_WAIT,
            present=request.HasField("timeout"),
        )
        async with self.streams.hold(context, "WaitMachine calls", _caller(context)):
            resp = await self._call(
                request.machine_id,
                "WaitMachine",
                w.WaitMachineRequest(
                    machine_id=request.machine_id,
                    state=request.state,
                    timeout=Duration(seconds=int(timeout), nanos=int(timeout % 1 * 1e9)),
                    instance_id=request.instance_id,
                    ready=request.ready,
                ),
                timeout=timeout + 5,
            )
        assert isinstance(resp, w.WaitMachineResponse)
        return m.WaitMachineResponse(machine=resp.machine)

    async def AcquireLease(
        self, request: m.AcquireLeaseRequest, context: grpc.aio.ServicerContext
    ) -> m.AcquireLeaseResponse:
        return await self._forward("AcquireLease", request)

    async def ReleaseLease(
        self, request: m.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> m.ReleaseLeaseResponse:
        return await self._forward("ReleaseLease", request)

    async def ListMachineEvents(
        self, request: m.ListMachineEventsRequest, context: grpc.aio.ServicerContext
    ) -> m.ListMachineEventsResponse:
        return await self._forward("ListMachineEvents", request)

    async def GetPlacement(
        self, request: m.GetPlacementRequest, context: grpc.aio.ServicerContext
    ) -> m.GetPlacementResponse:
        return await self._forward("GetPlacement", request)

    async def GetMachineLogs(
        self, request: m.GetMachineLogsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[m.GetMachineLogsResponse]:
        if not request.follow:
            async for item in self._logs(request):
                yield item
            return
        async with self.streams.hold(context, "GetMachineLogs follow streams", _caller(context)):
            async for item in self._logs(request):
                yield item

    async def _logs(
        self, request: m.GetMachineLogsRequest
    ) -> AsyncIterator[m.GetMachineLogsResponse]:
        stub = self.x.workers.stub(self.x.workers.owner(request.machine_id))
        # A followed stream lasts as long as the client wants it; the client's cancel ends it.
        call = stub.GetMachineLogs(
            w.GetMachineLogsRequest(
                machine_id=request.machine_id, follow=request.follow, tail_lines=request.tail_lines
            ),
            timeout=None if request.follow else RPC_TIMEOUT,
        )
        try:
            async for item in call:
                yield m.GetMachineLogsResponse(line=item.line, truncated_bytes=item.truncated_bytes)
        except grpc.aio.AioRpcError as err:
            raise Upstream(err) from None
        finally:
            call.cancel()


class PlatformServicer(platform_pb2_grpc.PlatformServiceServicer):
    """flaps.v1.PlatformService: the fleet as this flaps sees it."""

    def __init__(self, exchange: Exchange) -> None:
        self.x = exchange
        auth.scoped(
            self, platform_pb2.DESCRIPTOR.services_by_name["PlatformService"], exchange.app_of
        )

    async def ListRegions(
        self, request: platform_pb2.ListRegionsRequest, context: grpc.aio.ServicerContext
    ) -> platform_pb2.ListRegionsResponse:
        guest = request.guest
        sized = request.HasField("guest")
        if sized and (guest.cpu_millicores < 0 or guest.memory_mib < 0 or guest.disk_mib < 0):
            raise InvalidArgument("guest", "sizes must not be negative")
        out = []
        for name, pool in sorted(self.x.replica.supply.regions().items()):
            region = platform_pb2.Region(
                name=name, workers=pool.workers, alive_workers=pool.by_status[ALIVE]
            )
            for total, sums in ((region.total, pool.total), (region.free, pool.free)):
                total.cpu_millicores, total.memory_mib, total.disk_mib, total.machines = sums
            if sized:
                region.fits = region_fits(pool, guest)
            out.append(region)
        return platform_pb2.ListRegionsResponse(regions=out)

    async def ListWorkers(
        self, request: platform_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> platform_pb2.ListWorkersResponse:
        if request.region:
            self.x.regions_of(request.region, [])
        size = request.page_size or PAGE_SIZE
        if not 0 < size <= MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"must be between 1 and {MAX_PAGE_SIZE}")
        views, after = self.x.replica.worker_page(request.region or None, request.page_token, size)
        out = []
        for view in views:
            worker = platform_pb2.Worker(
                info=view.info,
                status=view.status,  # type: ignore[arg-type]
                capacity=view.capacity,
                seq=view.seq,
            )
            worker.last_heartbeat.FromNanoseconds(int(view.last_heartbeat * 1e9))
            out.append(worker)
        return platform_pb2.ListWorkersResponse(workers=out, next_page_token=after)

    async def SimulatePlacement(
        self, request: platform_pb2.SimulatePlacementRequest, context: grpc.aio.ServicerContext
    ) -> platform_pb2.SimulatePlacementResponse:
        check_name("app", request.app)
        regions = self.x.regions_of(request.region, request.regions)
        check_config(request.config)
        await self.x.check_image(request.config, app=request.app)  # a deploy's dry run says so
        bid = self.x.request(request.app, regions, request.config, request.standby_for, None)
        # A larger sample than a create ranks; the rest are explained by the counts.
        pipeline = dataclasses.replace(
            self.x.pipeline, sample_size=max(self.x.pipeline.sample_size, placement.SIMULATE_SAMPLE)
        )
        out = platform_pb2.SimulatePlacementResponse()
        for region in regions:
            decision = pipeline.decide(self.x.replica.supply, bid, region)
            for c in decision.candidates:
                out.candidates.add(
                    worker_id=c.worker_id, region=c.region, score=c.score, sub_scores=c.sub_scores
                )
            for r in decision.rejections:
                out.rejections.add(worker_id=r.worker_id, reason=r.reason, detail=r.detail)
            for reason, n in decision.counts().items():
                out.rejections_by_reason[reason] += n
        supply, labels = self.x.replica.supply, dict(bid.placement.required_labels)
        pools = [pool for r in regions if (pool := supply.pool(r, labels)) is not None]
        out.fits = sum(region_fits(pool, request.config.guest) for pool in pools)
        return out

    async def WatchPlacements(
        self, request: platform_pb2.WatchPlacementsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[platform_pb2.WatchPlacementsResponse]:
        async for response in self.x.watchers.watch(subscribed=context.send_initial_metadata):
            yield response

    async def CordonWorker(
        self, request: platform_pb2.CordonWorkerRequest, context: grpc.aio.ServicerContext
    ) -> platform_pb2.CordonWorkerResponse:
        check_name("worker_id", request.worker_id)
        if self.x.replica.worker(request.worker_id) is None:
            raise NotFound(f"worker {request.worker_id} not found")
        stub = self.x.workers.stub(request.worker_id)
        try:
            got = await stub.CordonWorker(
                w.CordonWorkerRequest(cordoned=request.cordoned), timeout=time_left(RPC_TIMEOUT)
            )
        except grpc.aio.AioRpcError as err:
            raise Upstream(err) from None
        log.info("worker_cordon", worker=request.worker_id, cordoned=got.cordoned)
        return platform_pb2.CordonWorkerResponse(cordoned=got.cordoned)


def region_fits(pool: Pool, guest: pb.GuestConfig) -> int:
    """How many machines of `guest`'s size fit in a region's pool (alive, uncordoned workers):
    bounded, see `Pool.room`."""
    return pool.room(guest.memory_mib, guest.cpu_millicores, guest_disk_mib(guest))
