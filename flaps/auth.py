"""Who may call flaps, and for what: every call is checked before any work is done.

A call comes either from a part of the cluster, with a certificate the cluster CA signed
(on flaps' `cluster_listen` port: the proxy, workers announcing themselves), which may make
the calls its role may (`PEER_ACCESS`, runtime.access: the proxy starts, promotes and stops
machines, nothing else; the registry flaps embeds has its own table, registry.access); or from
a client (the CLI, the SDK, grpcurl) with `authorization: Bearer <token>`, a macaroon
(model.tokens) that flaps verifies in constant time against its root keys, its expiry and the
revocation list (`TokenVerifier`). A missing, malformed, tampered, expired, revoked or
unknown-key token gets UNAUTHENTICATED; a valid one whose caveats do not allow the call gets
PERMISSION_DENIED naming the caveat, and a certificate whose role may not make the call gets
PERMISSION_DENIED naming the certificate and its role.

`RULES` says what each RPC needs (operations, and the app or machine they touch, or the
fleet: an operator token); a machine's app comes from the registry view, or from its worker
when the view has not seen it yet. A handler reads the caller's grant with `current_grant()`
(None: a cluster part) to return from a list only what the token may read. Log lines of the
call carry the token's id, never the token.

A rule also names every other object the request names (a `Need` with a `ref`: the machines
a create stands by for, its secrets' source, a supersede's primary): the token must allow
touching each, and, whoever calls, each must be of the app the call is about (model.scope).
`scoped` puts that second check in front of every handler, guarded or not, so it holds on a
flaps that checks no tokens too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import structlog
from google.protobuf.descriptor import ServiceDescriptor
from google.rpc import error_details_pb2
from opentelemetry import trace

from flaps.errors import NotFound, Upstream
from flaps.v1 import machines_pb2, platform_pb2
from model import scope
from model.scope import Ref
from model.tokens import Denied, Grant, InvalidToken, Keyring, KeysError, parse_revoked
from runtime import abort_with_details, access
from runtime.access import NOBODY, allow
from runtime.pki import OPERATOR, ClusterMembers
from runtime.tracing import tracing_enabled
from runtime.validate import check_name

__all__ = [
    "PEER_ACCESS",
    "RULES",
    "Authorizer",
    "KeySource",
    "Need",
    "RevocationList",
    "TokenVerifier",
    "check_scope",
    "current_grant",
    "guard",
    "scoped",
]

log = structlog.get_logger("flaps.auth")
REASON_DOMAIN = "flaps.nonomad"
# How often the root keys and the revocation list are looked at for a change.
KEYS_POLL = 1.0

_grant: ContextVar[Grant | None] = ContextVar("nonomad_flaps_grant", default=None)


def current_grant() -> Grant | None:
    """The grant of the token behind the call being handled; None for a cluster part (or when
    flaps checks no tokens): everything is allowed."""
    return _grant.get()


class Need(NamedTuple):
    """What a call needs: every one of `ops`, on `app` or on `machine` (whose app is looked
    up) when it is about one, or on the `fleet` (an operator token, model.tokens). With `ref`,
    the machine is another object the request names (in the field `ref.field`) than the one
    the call is about, its subject (the rule's first need): it must be of the subject's app
    too. (A tuple: made on every call, and a frozen dataclass costs several times more.)"""

    ops: tuple[str, ...]
    app: str | None = None
    machine: str | None = None
    fleet: bool = False
    ref: Ref | None = None


Rule = Callable[[Any], Sequence[Need]]


def _machine(*ops: str) -> Rule:
    return lambda request: [Need(ops, machine=request.machine_id)]


def _app(*ops: str) -> Rule:
    return lambda request: [Need(ops, app=request.app or None)]


def _fleet(*ops: str) -> Rule:
    return lambda request: [Need(ops, fleet=True)]


def _named(ops: tuple[str, ...], refs: Sequence[Ref]) -> list[Need]:
    return [Need(ops, machine=ref.id, ref=ref) for ref in refs]


def _standbys(request: Any) -> list[Need]:
    """A standby reads the machines it stands by for (flaps' `standby_for`, its config's
    `standbys`): the token must be allowed to read them."""
    named = [Ref(f"standby_for[{i}]", mid) for i, mid in enumerate(request.standby_for)]
    return _named(("read",), named + scope.config_refs(request.config))


def _create(request: Any) -> Sequence[Need]:
    # Secrets copied from a machine need what could read them there: changing its command.
    needs = [Need(("create",), app=request.app), *_standbys(request)]
    if request.secrets_from:
        needs += _named(("update",), [Ref("secrets_from", request.secrets_from)])
    return needs


def _update(request: Any) -> Sequence[Need]:
    return [
        Need(("update",), machine=request.machine_id),
        *_named(("read",), scope.config_refs(request.config)),
    ]


def _supersede(request: Any) -> Sequence[Need]:
    # Telling a machine it was outranked can stop it: what stopping it needs. Nothing is done
    # to the primary named, but the token must reach it (its apps and machines caveats), and
    # it must be of the machine's app.
    return [
        Need(("stop",), machine=request.machine_id),
        *_named((), [Ref("primary", request.primary)]),
    ]


RULES: dict[str, Rule] = {
    "/flaps.v1.MachinesService/CreateMachine": _create,
    "/flaps.v1.MachinesService/GetMachine": _machine("read"),
    "/flaps.v1.MachinesService/ListMachines": _app("read"),
    "/flaps.v1.MachinesService/UpdateMachine": _update,
    "/flaps.v1.MachinesService/StartMachine": _machine("start"),
    "/flaps.v1.MachinesService/StopMachine": _machine("stop"),
    "/flaps.v1.MachinesService/RestartMachine": _machine("stop", "start"),
    "/flaps.v1.MachinesService/SignalMachine": _machine("signal"),
    "/flaps.v1.MachinesService/DestroyMachine": _machine("destroy"),
    "/flaps.v1.MachinesService/WaitMachine": _machine("read"),
    "/flaps.v1.MachinesService/AcquireLease": _machine("lease"),
    "/flaps.v1.MachinesService/ReleaseLease": _machine("lease"),
    "/flaps.v1.MachinesService/ListMachineEvents": _machine("read"),
    "/flaps.v1.MachinesService/GetMachineLogs": _machine("read"),
    "/flaps.v1.MachinesService/SupersedeMachine": _supersede,
    "/flaps.v1.MachinesService/GetPlacement": _machine("read"),
    # The fleet, not an app's: an operator token (model.tokens).
    "/flaps.v1.PlatformService/ListRegions": _fleet("regions"),
    "/flaps.v1.PlatformService/ListWorkers": _fleet("workers"),
    # Placing away from the machines it would stand by for says where they are: read them.
    "/flaps.v1.PlatformService/SimulatePlacement": lambda request: [
        Need(("create",), app=request.app or None),
        *_standbys(request),
    ],
    # Every app's decisions, as they are made: reading them, on the fleet.
    "/flaps.v1.PlatformService/WatchPlacements": _fleet("read", "regions"),
    "/flaps.v1.PlatformService/CordonWorker": _fleet("cordon"),
}
"""What each client-facing RPC needs (from a token)."""


async def owner_app(ref: Ref, app_of: Callable[[str], Awaitable[str]]) -> str:
    """The app of the object `ref` names; INVALID_ARGUMENT naming its field when there is no
    such object. The one place each kind of object is found (a new kind adds its lookup)."""
    check_name(ref.field, ref.id)
    if ref.kind != scope.MACHINE:
        raise AssertionError(f"flaps cannot look up a {ref.kind} yet")
    try:
        return await app_of(ref.id)
    except NotFound:
        raise scope.missing(ref) from None
    except Upstream as err:
        if err.code == grpc.StatusCode.NOT_FOUND:
            raise scope.missing(ref) from None
        raise


async def check_scope(method: str, request: Any, app_of: Callable[[str], Awaitable[str]]) -> None:
    """Every other object the request names (its rule's needs with a `ref`) is of the app the
    call is about (model.scope), whoever calls; INVALID_ARGUMENT naming the field otherwise.
    `app_of`: a machine's app (NotFound when there is none)."""
    rule = RULES.get(method)
    if rule is None:
        return
    needs = rule(request)
    refs = [need.ref for need in needs if need.ref is not None]
    if not refs:
        return  # (most calls: nothing is looked up)
    subject = next(need for need in needs if need.ref is None)
    if subject.machine is not None:
        app = await app_of(subject.machine)
    else:
        app = subject.app or ""
        check_name("app", app)
    for ref in refs:
        scope.check(ref, app, await owner_app(ref, app_of))


def scoped(
    servicer: object, service: ServiceDescriptor, app_of: Callable[[str], Awaitable[str]]
) -> None:
    """Run `check_scope` before every handler of `service` on `servicer` (replacing them on
    the instance, as `guard` does; a guard put on later runs before it, so a token's caller is
    told what its token may not touch before anything about the objects named)."""

    async def check(method: str, request: Any, context: Any) -> None:
        await check_scope(method, request, app_of)

    _before_every_handler(servicer, service, check)


_PROXY = allow("proxy")
_READS = allow(OPERATOR)  # the CLI with the operator's certificate reads (--tls-cert)
PEER_ACCESS: access.Table = {
    **access.table(
        machines_pb2.DESCRIPTOR.services_by_name["MachinesService"],
        {
            "CreateMachine": NOBODY,
            "GetMachine": _READS,
            "ListMachines": _READS,
            "UpdateMachine": NOBODY,
            # A stopped machine started for a request (scale from zero), and a standby
            # promoted in its slot (a start with a generation) when its primary's worker died.
            "StartMachine": _PROXY,
            "StopMachine": _PROXY,  # an idle machine stopped (autostop)
            "RestartMachine": NOBODY,
            "SignalMachine": NOBODY,
            "DestroyMachine": NOBODY,
            "WaitMachine": _READS,
            "AcquireLease": NOBODY,
            "ReleaseLease": NOBODY,
            "ListMachineEvents": _READS,
            "GetMachineLogs": _READS,
            "SupersedeMachine": _PROXY,  # a copy that came back outranked, told so
            "GetPlacement": _READS,
        },
    ),
    **access.table(
        platform_pb2.DESCRIPTOR.services_by_name["PlatformService"],
        {
            "ListRegions": _READS,
            "ListWorkers": _READS,
            "SimulatePlacement": NOBODY,
            "WatchPlacements": _READS,
            "CordonWorker": NOBODY,
        },
    ),
}
"""What a cluster certificate may call of the Machines and Platform APIs on flaps' cluster
port, by its role: what the proxy calls (proxy.control.FlapsClient), and the reads of the
operator's CLI (`nonomad --flaps <cluster port> --tls-cert ...`). Every change but the
proxy's takes a token, on the public port; the console reads with its read-only token there,
its certificate reads nothing of these."""


class _WatchedFile:
    """A file read again when it changes (its inode, mtime or size), every KEYS_POLL."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reload(self) -> bool:
        """Read the file again if it changed; True when what it holds was replaced. A file
        that is now unusable is logged and what was held is kept."""
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp
        return self._read()

    def _read(self) -> bool:
        raise NotImplementedError

    async def watch(self, shutdown: asyncio.Event) -> None:
        """Look at the file every KEYS_POLL seconds until shutdown."""
        while not shutdown.is_set():
            self.reload()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(shutdown.wait(), KEYS_POLL)


class KeySource(_WatchedFile):
    """The root keys in a file, read again when the file changes (a key rotation)."""

    def __init__(self, path: Path) -> None:
        self.keyring = Keyring.load(path)  # a bad file stops flaps at start
        super().__init__(path)

    def _read(self) -> bool:
        try:
            self.keyring = Keyring.load(self.path)
        except KeysError as err:
            log.error("token_keys_unusable", error=str(err), keeping=self.keyring.ids)
            return False
        log.info("token_keys_reloaded", keys=self.keyring.ids, current=self.keyring.current)
        return True


class RevocationList(_WatchedFile):
    """The ids of revoked tokens, one a line of a file (`nonomad tokens revoke`), read again
    when it changes. A missing file revokes nothing; a bad one stops flaps at start."""

    def __init__(self, path: Path) -> None:
        self.revoked = self._load(path)
        super().__init__(path)

    @staticmethod
    def _load(path: Path) -> frozenset[str]:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return frozenset()
        except OSError as err:
            raise ValueError(f"{path}: {err.strerror or err}") from None
        return parse_revoked(text, str(path))

    def _read(self) -> bool:
        try:
            revoked = self._load(self.path)
        except ValueError as err:
            log.error("revoked_tokens_unusable", error=str(err), keeping=len(self.revoked))
            return False
        added = len(revoked - self.revoked)
        self.revoked = revoked
        log.info("revoked_tokens_reloaded", revoked=len(revoked), added=added)
        return True


class TokenVerifier:
    """Verifies a token as every call to flaps does: `keys()` (the root keys: signature and
    expiry, at `now()`, Unix seconds) and `revoked()` (the ids no longer honoured)."""

    def __init__(
        self,
        keys: Callable[[], Keyring],
        revoked: Callable[[], frozenset[str]] = frozenset,
        now: Callable[[], float] | None = None,
    ) -> None:
        self.keys = keys
        self.revoked = revoked
        self.now = now

    def verify(self, token: str) -> Grant:
        """The token's grant; InvalidToken (saying why) when it is not valid."""
        grant = self.keys().verify(token, now=None if self.now is None else self.now())
        if grant.token_id in self.revoked():
            raise InvalidToken(f"token {grant.token_id} was revoked")
        return grant


class Authorizer:
    """Checks a call: who it is from, and whether their token allows what the RPC needs.

    `tokens` verifies a token (TokenVerifier); `app_of(machine_id)` gives the machine's app
    (raising the service's NotFound when there is no such machine); `members` recognises the
    certificates of the cluster's parts (None: no caller is one).
    """

    def __init__(
        self,
        tokens: TokenVerifier,
        app_of: Callable[[str], Awaitable[str]],
        members: ClusterMembers | None = None,
    ) -> None:
        self.tokens = tokens
        self.app_of = app_of
        self.members = members

    async def check(self, method: str, request: Any, context: Any) -> Grant | None:
        """The caller's grant (None for a cluster part its role allows); aborts the call
        otherwise."""
        peer = self.members.identity_of(context) if self.members is not None else None
        if peer is not None:
            why = access.refusal(PEER_ACCESS, method, peer, request)
            if why is not None:
                await access.deny(
                    context, method, peer, f"{why}; use a token on flaps' public port"
                )
            return None
        rule = RULES.get(method)
        if rule is None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} is for the cluster's own parts: call flaps' cluster port "
                "with a cluster certificate",
            )
            raise AssertionError("abort returns only by raising")
        try:
            grant = self.tokens.verify(_bearer(context))
        except InvalidToken as err:
            log.info("unauthenticated", method=method, reason=str(err))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"authorization: {err}")
            raise AssertionError("abort returns only by raising") from None
        # From here on, every line the call logs names the token (a machine not found while
        # its app is looked up, too). gRPC runs each call in a task of its own, so nothing is
        # reset: the error mapping around the handler (runtime.server: `rpc_error`,
        # `rpc_failed`) logs after the handler has returned, and carries it as well.
        structlog.contextvars.bind_contextvars(token_id=grant.token_id)
        try:
            for need in rule(request):
                app = need.app
                if app is None and need.machine and grant.limits_apps:
                    app = await (
                        owner_app(need.ref, self.app_of) if need.ref else self.app_of(need.machine)
                    )
                grant.check(need.ops, app, need.machine or None, fleet=need.fleet)
        except Denied as err:
            log.info("permission_denied", method=method, token_id=grant.token_id, reason=str(err))
            await abort_with_details(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                str(err),
                error_details_pb2.ErrorInfo(
                    reason="TOKEN_CAVEAT",
                    domain=REASON_DOMAIN,
                    metadata={"caveat": err.caveat.text, "token_id": grant.token_id},
                ),
            )
        if tracing_enabled():  # else no span records it, and looking one up costs
            trace.get_current_span().set_attribute("nonomad.token_id", grant.token_id)
        return grant


def _bearer(context: Any) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise InvalidToken("expected `authorization: Bearer <token>`")
            return token
    raise InvalidToken("missing `authorization: Bearer <token>` metadata")


def guard(servicer: object, service: ServiceDescriptor, authorizer: Authorizer) -> None:
    """Check every call of `service` on `servicer` with `authorizer` before its handler runs.

    Replaces the handlers on the instance (before `Service.add`, whose error mapping then
    wraps these). A handler runs with the grant in `current_grant()`, and every log line of
    the call, the error mapping's too, carries the token's id.
    """

    async def check(method: str, request: Any, context: Any) -> None:
        # Set for the rest of the call, never reset: the call's task is its own (and the
        # token's id was bound by `check`). A stream's too: a context manager would reset in
        # whatever context runs the generator's last step.
        _grant.set(await authorizer.check(method, request, context))

    _before_every_handler(servicer, service, check)


Before = Callable[[str, Any, Any], Awaitable[None]]
"""A check awaited before a handler: (full method name, request, context)."""


def _before_every_handler(servicer: object, service: ServiceDescriptor, before: Before) -> None:
    """Replace each handler of `service` on the instance `servicer` by one that awaits
    `before` first (in the call's own context), then runs the handler."""
    for method in service.methods:
        handler = getattr(servicer, method.name, None)
        if handler is None:
            continue
        full_method = f"/{service.full_name}/{method.name}"
        if inspect.isasyncgenfunction(handler):
            setattr(servicer, method.name, _checked_stream(handler, full_method, before))
        elif inspect.iscoroutinefunction(handler):
            setattr(servicer, method.name, _checked_unary(handler, full_method, before))


def _checked_unary(
    handler: Callable[[Any, Any], Awaitable[Any]], method: str, before: Before
) -> Callable[[Any, Any], Awaitable[Any]]:
    @functools.wraps(handler)
    async def checked(request: Any, context: Any) -> Any:
        await before(method, request, context)
        return await handler(request, context)

    return checked


def _checked_stream(
    handler: Callable[[Any, Any], AsyncGenerator[Any, None]], method: str, before: Before
) -> Callable[[Any, Any], AsyncIterator[Any]]:
    @functools.wraps(handler)
    async def checked(request: Any, context: Any) -> AsyncIterator[Any]:
        await before(method, request, context)
        async with contextlib.aclosing(handler(request, context)) as responses:
            async for response in responses:
                yield response

    return checked
