"""Two optional parts of every service: bearer-token authentication and a Prometheus endpoint.

Both are off unless configured (`auth_token_file`, `metrics_listen`), and cost nothing then.
Services define their metrics with `prometheus_client` in the default registry; the endpoint
serves whatever is registered there.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from prometheus_client import start_http_server

__all__ = ["METRICS_PREFIX", "MetricsEndpoint", "TokenAuth"]

METRICS_PREFIX = "NONOMAD_METRICS"
"""Printed as `NONOMAD_METRICS <service> <host:port>` once the metrics endpoint listens."""

# Probes and tooling must work without the token: a load balancer's health check and grpcurl's
# `list`/`describe` reveal nothing a caller could act on.
_OPEN_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuse calls without `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        if method.startswith(_OPEN_PREFIXES):
            return await continuation(handler_call_details)
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                break
        if hmac.compare_digest(given, self._expected):
            return await continuation(handler_call_details)
        detail = "missing authorization metadata" if not given else "invalid bearer token"
        return _deny(detail, await continuation(handler_call_details))


def _deny(detail: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def unary(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"authorization: {detail}")

    async def streaming(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"authorization: {detail}")
        yield  # pragma: no cover - makes this an async generator

    deserializer = handler.request_deserializer if handler else None
    serializer = handler.response_serializer if handler else None
    if handler is not None and handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(streaming, deserializer, serializer)
        return grpc.unary_stream_rpc_method_handler(streaming, deserializer, serializer)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(unary, deserializer, serializer)


class MetricsEndpoint:
    """Prometheus text format at `http://<address>/metrics`, served from a daemon thread."""

    def __init__(self, listen: str) -> None:
        from runtime.settings import parse_host_port

        host, port = parse_host_port(listen)
        self._server, self._thread = start_http_server(port, addr=host)
        bound = self._server.server_port
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        thread: threading.Thread = self._thread
        thread.join(timeout=5)
