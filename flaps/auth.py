"""Who may call flaps, and for what: every call is checked before any work is done.

A call comes either from a part of the cluster, with a certificate the cluster CA signed
(on flaps' `cluster_listen` port: the proxy, workers announcing themselves), which may do
anything; or from a client (the CLI, the SDK, grpcurl) with `authorization: Bearer <token>`,
a macaroon (flaps.tokens) that flaps verifies in constant time against its root keys. A
missing, malformed, tampered, expired or unknown-key token gets UNAUTHENTICATED; a valid one
whose caveats do not allow the call gets PERMISSION_DENIED naming the caveat. The registry
service that flaps embeds is for the cluster's parts only.

`RULES` says what each RPC needs (operations, and the app or machine they touch); a machine's
app comes from the registry view, or from its worker when the view has not seen it yet. A
handler reads the caller's grant with `current_grant()` (None: a cluster part, allowed all) to
return from a list only what the token may read. Log lines of the call carry the token's id,
never the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from google.protobuf.descriptor import ServiceDescriptor
from google.rpc import error_details_pb2
from opentelemetry import trace

from flaps.tokens import Denied, Grant, InvalidToken, Keyring, KeysError
from runtime import abort_with_details
from runtime.pki import ClusterMembers

__all__ = ["RULES", "Authorizer", "KeySource", "Need", "current_grant", "guard"]

log = structlog.get_logger("flaps.auth")
REASON_DOMAIN = "flaps.nonomad"
# How often the root keys file is looked at for a rotation.
KEYS_POLL = 1.0

_grant: ContextVar[Grant | None] = ContextVar("nonomad_flaps_grant", default=None)


def current_grant() -> Grant | None:
    """The grant of the token behind the call being handled; None for a cluster part (or when
    flaps checks no tokens): everything is allowed."""
    return _grant.get()


@dataclass(frozen=True)
class Need:
    """What a call needs: every one of `ops`, on `app` or on `machine` (whose app is looked
    up) when it is about one."""

    ops: tuple[str, ...]
    app: str | None = None
    machine: str | None = None


Rule = Callable[[Any], Sequence[Need]]


def _machine(*ops: str) -> Rule:
    return lambda request: [Need(ops, machine=request.machine_id)]


def _app(*ops: str) -> Rule:
    return lambda request: [Need(ops, app=request.app or None)]


def _fleet(*ops: str) -> Rule:
    return lambda request: [Need(ops)]


def _create(request: Any) -> Sequence[Need]:
    # A standby reads its primaries: the token must be allowed to read them too. Secrets
    # copied from a machine need what could read them there: changing its command.
    needs = [Need(("create",), app=request.app)] + [
        Need(("read",), machine=primary) for primary in request.standby_for
    ]
    if request.secrets_from:
        needs.append(Need(("update",), machine=request.secrets_from))
    return needs


RULES: dict[str, Rule] = {
    "/flaps.v1.MachinesService/CreateMachine": _create,
    "/flaps.v1.MachinesService/GetMachine": _machine("read"),
    "/flaps.v1.MachinesService/ListMachines": _app("read"),
    "/flaps.v1.MachinesService/UpdateMachine": _machine("update"),
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
    # Telling a machine it was outranked can stop it: what stopping it needs.
    "/flaps.v1.MachinesService/SupersedeMachine": _machine("stop"),
    "/flaps.v1.MachinesService/GetPlacement": _machine("read"),
    "/flaps.v1.PlatformService/ListRegions": _fleet("regions"),
    "/flaps.v1.PlatformService/ListWorkers": _fleet("workers"),
    "/flaps.v1.PlatformService/SimulatePlacement": _app("create"),
    # Every app's decisions, as they are made: read on every app ("*"), and the fleet's view.
    "/flaps.v1.PlatformService/WatchPlacements": lambda request: [
        Need(("read", "regions"), app="*")
    ],
}
"""What each client-facing RPC needs. A method of a guarded service missing here is served
to the cluster's parts only (the registry)."""


class KeySource:
    """The root keys in a file, read again when the file changes (a key rotation)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.keyring = Keyring.load(path)  # a bad file stops flaps at start
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reload(self) -> bool:
        """Read the file again if it changed; True when the keys were replaced. A file that is
        now unusable is logged and the keys held are kept."""
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp
        try:
            self.keyring = Keyring.load(self.path)
        except KeysError as err:
            log.error("token_keys_unusable", error=str(err), keeping=self.keyring.ids)
            return False
        log.info("token_keys_reloaded", keys=self.keyring.ids, current=self.keyring.current)
        return True

    async def watch(self, shutdown: asyncio.Event) -> None:
        """Look at the file every KEYS_POLL seconds until shutdown."""
        while not shutdown.is_set():
            self.reload()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(shutdown.wait(), KEYS_POLL)


class Authorizer:
    """Checks a call: who it is from, and whether their token allows what the RPC needs.

    `keys()` returns the keyring to verify with; `app_of(machine_id)` the machine's app
    (raising the service's NotFound when there is no such machine); `members` recognises the
    certificates of the cluster's parts (None: no caller is one).
    """

    def __init__(
        self,
        keys: Callable[[], Keyring],
        app_of: Callable[[str], Awaitable[str]],
        members: ClusterMembers | None = None,
    ) -> None:
        self.keys = keys
        self.app_of = app_of
        self.members = members

    async def check(self, method: str, request: Any, context: Any) -> Grant | None:
        """The caller's grant (None for a cluster part); aborts the call otherwise."""
        if self.members is not None and self.members.name_of(context) is not None:
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
            grant = self.keys().verify(_bearer(context))
        except InvalidToken as err:
            log.info("unauthenticated", method=method, reason=str(err))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"authorization: {err}")
            raise AssertionError("abort returns only by raising") from None
        try:
            for need in rule(request):
                app = need.app
                if app is None and need.machine and grant.limits_apps:
                    app = await self.app_of(need.machine)
                grant.check(need.ops, app, need.machine or None)
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
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("nonomad.token_id", grant.token_id)
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
    wraps these). A unary handler runs with the grant in `current_grant()` and the token's id
    bound to every log line it writes.
    """
    for method in service.methods:
        handler = getattr(servicer, method.name, None)
        if handler is None:
            continue
        full_method = f"/{service.full_name}/{method.name}"
        if inspect.isasyncgenfunction(handler):
            setattr(servicer, method.name, _guard_stream(handler, full_method, authorizer))
        elif inspect.iscoroutinefunction(handler):
            setattr(servicer, method.name, _guard_unary(handler, full_method, authorizer))


def _guard_unary(
    handler: Callable[[Any, Any], Awaitable[Any]], method: str, authorizer: Authorizer
) -> Callable[[Any, Any], Awaitable[Any]]:
    @functools.wraps(handler)
    async def guarded(request: Any, context: Any) -> Any:
        grant = await authorizer.check(method, request, context)
        if grant is None:
            return await handler(request, context)
        token = _grant.set(grant)
        try:
            with structlog.contextvars.bound_contextvars(token_id=grant.token_id):
                return await handler(request, context)
        finally:
            _grant.reset(token)

    return guarded


def _guard_stream(
    handler: Callable[[Any, Any], AsyncGenerator[Any, None]], method: str, authorizer: Authorizer
) -> Callable[[Any, Any], AsyncIterator[Any]]:
    @functools.wraps(handler)
    async def guarded(request: Any, context: Any) -> AsyncIterator[Any]:
        # No grant for streams' handlers (none filters by it), and nothing context-bound:
        # a stream's steps may run in another context than the one that opened it.
        await authorizer.check(method, request, context)
        async with contextlib.aclosing(handler(request, context)) as responses:
            async for response in responses:
                yield response

    return guarded
