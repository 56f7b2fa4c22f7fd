"""OpenTelemetry tracing, configured only from the standard `OTEL_*` environment variables,
and the one way the project builds gRPC client channels (`aio_channel`).

Tracing is on iff an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), `OTEL_SDK_DISABLED` is not true and
`OTEL_TRACES_EXPORTER` is not `none`. When it is off, no interceptor is installed on servers or
channels, so the call path pays nothing for it.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import structlog
from opentelemetry import trace

from runtime import transport

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = [
    "CLUSTER_NAME",
    "DEFAULT_CHANNEL_OPTIONS",
    "ChannelOption",
    "ChannelTLS",
    "aio_channel",
    "client_interceptors",
    "server_interceptors",
    "setup_tracing",
    "shutdown_tracing",
    "tracing_enabled",
    "tracing_requested",
]

_log = structlog.get_logger(__name__)

ChannelOption = tuple[str, int | str]

# Keepalive lets a client notice a dead peer on an idle or quiet streaming connection within
# ~40 s instead of waiting for TCP to give up. Servers built by `Service` accept pings this
# often (see server.SERVER_OPTIONS); other servers may answer GOAWAY "too_many_pings".
DEFAULT_CHANNEL_OPTIONS: Mapping[str, int | str] = {
    "grpc.keepalive_time_ms": 30_000,
    "grpc.keepalive_timeout_ms": 10_000,
    "grpc.keepalive_permit_without_calls": 1,
    # Event streams can go a long time without data; keep pinging through them.
    "grpc.http2.max_pings_without_data": 0,
}


@dataclass
class _Tracing:
    provider: TracerProvider
    server_interceptors: list[object]
    client_interceptors: list[object]


_lock = threading.Lock()
_state: _Tracing | None = None


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


def tracing_requested() -> bool:
    """Whether the `OTEL_*` environment asks for traces to be exported."""
    if _env_true("OTEL_SDK_DISABLED"):
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def tracing_enabled() -> bool:
    """Whether `setup_tracing` turned tracing on (and `shutdown_tracing` has not run)."""
    return _state is not None


def setup_tracing(service: str, **resource_attrs: str) -> bool:
    """Turn tracing on if the environment asks for it; return whether it is on.

    The resource gets `service.name=service` plus `resource_attrs`; dotted keys are passed as
    `**{"nonomad.worker": worker, "cloud.region": region}`. `OTEL_RESOURCE_ATTRIBUTES`,
    `OTEL_TRACES_SAMPLER(_ARG)` and the exporter's `OTEL_EXPORTER_OTLP_*` settings are read by
    the SDK itself. Calling it again once tracing is on changes nothing.
    """
    global _state
    with _lock:
        if _state is not None:
            return True
        if not tracing_requested():
            return False
        for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = os.environ.get(var, "grpc")
            if protocol != "grpc":
                # Only the gRPC exporter is a dependency; say so rather than fail silently.
                _log.warning("otlp_protocol_unsupported", variable=var, protocol=protocol)
                break

        # Imported here: the SDK and the exporter cost a process with tracing off (every CLI
        # command) about half a second of imports.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # Explicit attributes win over OTEL_RESOURCE_ATTRIBUTES, which Resource.create merges.
        resource = Resource.create({**resource_attrs, SERVICE_NAME: service})
        # shutdown_on_exit is off because the atexit hook below shuts down exactly once.
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)

        # Imported here so a process with tracing off never loads the instrumentation.
        from opentelemetry.instrumentation.grpc import (
            aio_client_interceptors,
            aio_server_interceptor,
        )
        from opentelemetry.instrumentation.grpc.filters import (
            any_of,
            health_check,
            negate,
            service_prefix,
        )

        # Health probes and grpcurl's reflection calls would drown the interesting spans.
        not_infrastructure = negate(any_of(health_check(), service_prefix("grpc.reflection.")))
        _state = _Tracing(
            provider=provider,
            server_interceptors=[
                aio_server_interceptor(tracer_provider=provider, filter_=not_infrastructure)
            ],
            client_interceptors=list(aio_client_interceptors(tracer_provider=provider)),
        )
    atexit.register(shutdown_tracing)
    _log.info("tracing_enabled", service=service)
    return True


def server_interceptors() -> list[object]:
    """Interceptors for a `grpc.aio.server`: the OpenTelemetry one when tracing is on, else []."""
    state = _state
    return list(state.server_interceptors) if state is not None else []


def client_interceptors() -> list[object]:
    """Interceptors for a `grpc.aio` channel: OpenTelemetry's when tracing is on, else []."""
    state = _state
    return list(state.client_interceptors) if state is not None else []


def shutdown_tracing() -> None:
    """Export the spans still buffered and stop tracing. Safe to call more than once.

    Blocks for up to the exporter timeout when the collector is unreachable; call it from a
    thread (`asyncio.to_thread`) inside an event loop.
    """
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None:
        state.provider.shutdown()


CLUSTER_NAME = "nonomad.cluster"
"""The DNS name every cluster certificate carries (runtime.pki): what a part of the cluster
checks in the certificate of another it calls, whatever address it dialled."""


@dataclass(frozen=True)
class ChannelTLS:
    """How a client channel verifies the server and, for mutual TLS, identifies itself.

    `ca` is a PEM bundle of roots to trust (None: the system roots); `cert` and `key` are the
    client's PEM certificate chain and key, both or neither; `server_name` overrides the name
    checked against the server certificate (for servers reached by IP address).
    """

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("ChannelTLS: cert and key go together; set both or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        """Read the files and build channel credentials."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


def aio_channel(
    target: str,
    *,
    tls: ChannelTLS | None = None,
    options: Sequence[ChannelOption] = (),
) -> grpc.aio.Channel:
    """Open a `grpc.aio` channel to `target` with the project's keepalive and tracing.

    Every client in the project builds its channels here so trace context flows across all
    hops when tracing is on. `options` are added to (and override) DEFAULT_CHANNEL_OPTIONS.
    Plaintext unless `tls` is given. The channel is the running task's transport's
    (runtime.transport: real gRPC unless a simulated node's).
    """
    merged = dict(DEFAULT_CHANNEL_OPTIONS)
    if tls is not None and tls.server_name:
        merged["grpc.ssl_target_name_override"] = tls.server_name
    merged.update(dict(options))
    channel_options = list(merged.items())
    # None rather than [] documents that nothing sits on the call path when tracing is off.
    interceptors = client_interceptors() or None
    return transport.current().channel(
        target,
        credentials=None if tls is None else tls.credentials(),
        options=channel_options,
        interceptors=interceptors,
    )
