"""Who may call what between the parts of the cluster: a table per service, default deny.

Every cluster certificate names its role (`runtime.pki.ROLES`). Each service states, for each
of its RPCs, the roles that may call it (`allow("flaps")`), and for some a condition on the
request as well (`allow("flyd", when=...)`: a worker announces only itself). An RPC without a
row cannot be registered (`table` raises), a role not in the row is refused, and so is a call
with no certificate or one that names no role: PERMISSION_DENIED, naming the certificate, its
role and the RPC, with an ErrorInfo whose reason is `CERTIFICATE_ROLE`.

`guard(servicer, service, table, members)` puts the check in front of every handler;
`add(service, table, ...)` adds a servicer to a `runtime.Service` so guarded whenever the
service serves TLS (one without TLS knows no caller, and checks none). flaps checks its own
Machines and Platform APIs (tokens on its public port, `refusal` with its table on its
cluster port).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import structlog
from google.protobuf.descriptor import ServiceDescriptor
from google.rpc import error_details_pb2

from runtime.limits import DEFAULT_LIMITS, Limits
from runtime.pki import ROLES, ClusterMembers, Identity
from runtime.server import ErrorMapper, Service
from runtime.status import abort_with_details

__all__ = [
    "NOBODY",
    "REASON",
    "Allow",
    "Table",
    "add",
    "allow",
    "deny",
    "guard",
    "members_of",
    "refusal",
    "table",
]

log = structlog.get_logger("runtime.access")

REASON = "CERTIFICATE_ROLE"
"""The ErrorInfo reason of a call refused for its certificate's role."""
DOMAIN = "nonomad"

Condition = Callable[[Identity, Any], str | None]
"""(caller, request) -> None when the request is one the caller may make, else why not."""


@dataclass(frozen=True)
class Allow:
    """Who may call one RPC: these roles, each only for requests `when` accepts (if given)."""

    roles: frozenset[str]
    when: Condition | None = None


def allow(*roles: str, when: Condition | None = None) -> Allow:
    """The row of an RPC: the roles that may call it (none: nobody over mutual TLS)."""
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)} (known: {', '.join(ROLES)})")
    return Allow(frozenset(roles), when)


NOBODY = allow()
"""The row of an RPC no part of the cluster calls."""

Table = Mapping[str, Allow]
"""Rows by full method name (`/flyd.v1.WorkerService/CreateMachine`)."""


def table(service: ServiceDescriptor, rows: Mapping[str, Allow]) -> dict[str, Allow]:
    """`rows` (by method name) as a Table of `service`; ValueError when an RPC of the service
    has no row, or a row names no RPC of it: every RPC is decided, none by default."""
    methods = {method.name for method in service.methods}
    missing, extra = methods - set(rows), set(rows) - methods
    if missing or extra:
        raise ValueError(
            f"{service.full_name}: no row for {sorted(missing)}; rows for no RPC {sorted(extra)}"
        )
    return {f"/{service.full_name}/{name}": row for name, row in rows.items()}


def refusal(rows: Table, method: str, caller: Identity | None, request: Any) -> str | None:
    """Why `caller` may not make this call (None: it may)."""
    if caller is None:
        return f"{method} is for the cluster's parts: call it with a cluster certificate"
    if caller.role is None:
        return (
            f"the cluster certificate {caller.name!r} names no role (made before roles were): "
            "issue its part a new one (`nonomad up` does)"
        )
    row = rows.get(method)
    if row is None or caller.role not in row.roles:
        who = ", ".join(sorted(row.roles)) if row is not None and row.roles else "no part"
        return (
            f"the cluster certificate {caller} may not call {method}: "
            f"{who} may (role {caller.role} may not)"
        )
    if row.when is not None:
        why = row.when(caller, request)
        if why is not None:
            return f"the cluster certificate {caller} may not call {method}: {why}"
    return None


async def deny(context: Any, method: str, caller: Identity | None, why: str) -> NoReturn:
    """End the call PERMISSION_DENIED for `why`, with the certificate's name and role."""
    metadata = {"method": method}
    if caller is not None:
        metadata.update(certificate=caller.name, role=caller.role or "")
    log.info("role_denied", method=method, certificate=metadata.get("certificate"), why=why)
    await abort_with_details(
        context,
        grpc.StatusCode.PERMISSION_DENIED,
        why,
        error_details_pb2.ErrorInfo(reason=REASON, domain=DOMAIN, metadata=metadata),
    )


def guard(
    servicer: object, service: ServiceDescriptor, rows: Table, members: ClusterMembers | None
) -> None:
    """Check every call of `service` on `servicer` against `rows` before its handler runs.

    `members` recognises the cluster's certificates (None: none is, and every call is
    refused). Replaces the handlers on the instance, as `runtime.wrap_servicer` does (call it
    first: the error mapping then wraps these).
    """
    for method in service.methods:
        full = f"/{service.full_name}/{method.name}"
        if full not in rows:
            raise ValueError(f"no row for {full}: every RPC needs one")
        handler = getattr(servicer, method.name, None)
        if inspect.isasyncgenfunction(handler):
            setattr(servicer, method.name, _stream(handler, full, rows, members))
        elif inspect.iscoroutinefunction(handler):
            setattr(servicer, method.name, _unary(handler, full, rows, members))


def members_of(service: Service) -> ClusterMembers | None:
    """What recognises the cluster's certificates for `service`: its cluster CA (or the CA its
    mutual TLS trusts); None when it has neither."""
    settings = service.settings
    ca = settings.cluster_ca or settings.tls_client_ca
    return ClusterMembers(ca) if ca is not None else None


def add(
    service: Service,
    rows: Table,
    servicer: Any,
    add_to_server: Callable[[Any, Any], None],
    descriptor: ServiceDescriptor,
    mapper: ErrorMapper,
    limits: Limits = DEFAULT_LIMITS,
) -> None:
    """`service.add(servicer, ...)`, every call checked against `rows` first when the service
    serves TLS. Without TLS nobody is known, so nobody is checked: said once, in its log."""
    if service.settings.tls_enabled:
        guard(servicer, descriptor, rows, members_of(service))
    else:
        log.warning(
            "no_caller_checks", service=descriptor.full_name, consequence="no TLS: any caller"
        )
    service.add(servicer, add_to_server, descriptor, mapper, limits)


async def _check(
    rows: Table, method: str, members: ClusterMembers | None, request: Any, context: Any
) -> None:
    caller = members.identity_of(context) if members is not None else None
    why = refusal(rows, method, caller, request)
    if why is not None:
        await deny(context, method, caller, why)


def _unary(
    handler: Callable[[Any, Any], Awaitable[Any]],
    method: str,
    rows: Table,
    members: ClusterMembers | None,
) -> Callable[[Any, Any], Awaitable[Any]]:
    @functools.wraps(handler)
    async def checked(request: Any, context: Any) -> Any:
        await _check(rows, method, members, request, context)
        return await handler(request, context)

    return checked


def _stream(
    handler: Callable[[Any, Any], AsyncGenerator[Any, None]],
    method: str,
    rows: Table,
    members: ClusterMembers | None,
) -> Callable[[Any, Any], AsyncIterator[Any]]:
    @functools.wraps(handler)
    async def checked(request: Any, context: Any) -> AsyncIterator[Any]:
        await _check(rows, method, members, request, context)
        async with contextlib.aclosing(handler(request, context)) as responses:
            async for response in responses:
                yield response

    return checked
