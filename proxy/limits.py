"""The data plane's bounds (`Limits`), checked when they are made; proxy.settings reads them
from the environment."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one client or one machine can make the proxy hold or wait for."""

    max_header_bytes: int = 16 * 1024
    max_body_bytes: int = 10 * 1024 * 1024
    # Slowloris: from a connection's first byte (or the first byte of the next request on a
    # kept-alive one) to the end of the request head.
    header_timeout: float = 10.0
    # A kept-alive client connection with no request in progress is closed after this.
    idle_keepalive: float = 60.0
    # Longest wait for the next piece of a request body, and longest a client may leave the
    # response unread (its socket buffer full).
    body_timeout: float = 30.0
    # Longest wait for the next piece of a response body from a machine.
    read_timeout: float = 30.0
    upstream_connect_timeout: float = 2.0
    # From the request sent (its last byte) to the response head.
    upstream_response_timeout: float = 60.0
    # An idle pooled connection to a machine is closed after this.
    upstream_idle_timeout: float = 30.0
    max_connections: int = 10_000
    # From one client address. At `max_connections`, an idle connection of the client holding
    # the most is cut off to make room for a newcomer, so one client cannot starve the others.
    max_connections_per_client: int = 512
    # Idle connections kept per machine.
    pool_size_per_backend: int = 64
    # Connections open (or opening) to one machine, busy and idle: a flood of slow requests to
    # one app without a hard limit cannot make the edge open more, so neither the machine nor
    # the descriptors of the edge and of the worker's netd are spent by one app. A request
    # that finds its machine at the cap waits (up to upstream_connect_timeout) for one of its
    # connections to come free, then gets a 503.
    max_connections_per_machine: int = 256
    # Extra attempts, on other machines, for a GET/HEAD whose connection was refused.
    max_retries: int = 2
    # Request body buffered (per request) before a backend is ready, before reading pauses.
    buffer_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in (
            "header_timeout",
            "idle_keepalive",
            "body_timeout",
            "read_timeout",
            "upstream_connect_timeout",
            "upstream_response_timeout",
            "upstream_idle_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_body_bytes", "pool_size_per_backend", "max_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in (
            "max_header_bytes",
            "max_connections",
            "max_connections_per_client",
            "max_connections_per_machine",
            "buffer_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
