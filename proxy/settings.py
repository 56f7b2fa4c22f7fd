"""The proxy's settings (env prefix `PROXY_`): where it listens, what it follows, its timings.

Worker death is noticed within `suspect_after` (no heartbeat for that long) plus
`probe_timeout` (the direct probe that confirms it) plus one registry liveness tick: 0.85 s
with the defaults, against flyd's heartbeat every 0.2 s.
"""

from __future__ import annotations

from dataclasses import fields
from ipaddress import ip_network

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from proxy.forwarded import Network
from proxy.limits import Limits
from proxy.pins import GRANT_TTL
from proxy.routes import RouterConfig
from registry.settings import ReplicaSettings
from runtime import parse_host_port
from runtime.validate import is_name


class ProxySettings(ReplicaSettings):
    """Settings of one edge proxy (any number may run; they share nothing)."""

    model_config = SettingsConfigDict(env_prefix="PROXY_")

    http_listen: str = Field(
        default="127.0.0.1:8080", description="HTTP listen address host:port; port 0: any free"
    )
    domain: str = Field(
        default="nonomad.localhost",
        description="apps are served as <app>.<domain> (*.localhost resolves to loopback)",
    )
    region: str = Field(default="local", description="this proxy's region: preferred machines")
    flaps: str | None = Field(
        default=None,
        description="flaps address host:port to start and stop machines through: its "
        "cluster_listen port when the cluster runs mutual TLS (without it: no scale from zero, "
        "autostop or failover)",
    )
    # The replica's, with the edge's own default: a silent worker is probed sooner.
    suspect_after: float = Field(
        default=0.5, gt=0, description="s without heartbeat before a worker is probed"
    )
    probe_timeout: float = Field(
        default=0.3, gt=0, description="deadline of the direct probe of a silent worker, s"
    )
    probe_interval: float = Field(
        default=0.5, gt=0, description="s between probes of a silent worker that answers"
    )
    idle_timeout: float = Field(
        default=300.0, gt=0, description="s without a request before an autostop machine stops"
    )
    autostop_interval: float = Field(
        default=1.0, gt=0, description="s between looks for idle machines"
    )
    cold_start_timeout: float = Field(
        default=10.0, gt=0, description="longest a request waits for a machine to start, s"
    )
    queue_wait: float = Field(
        default=2.0, gt=0, description="longest a request waits for a slot under a hard limit, s"
    )
    unhealthy_for: float = Field(
        default=2.0, gt=0, description="s a machine that refused a connection gets no traffic"
    )
    check_concurrency: int = Field(default=64, ge=1, description="health checks at once")
    flaps_timeout: float = Field(default=10.0, gt=0, description="deadline of a flaps call, s")
    # The data plane's bounds (proxy.limits.Limits): what one client or machine can make the
    # proxy hold or wait for.
    max_header_bytes: int = Field(default=16 * 1024, ge=256, description="request head bytes")
    max_body_bytes: int = Field(default=10 * 1024 * 1024, ge=0, description="request body bytes")
    header_timeout: float = Field(
        default=10.0, gt=0, description="s from a request's first byte to the end of its head"
    )
    idle_keepalive: float = Field(
        default=60.0, gt=0, description="s an idle kept-alive client connection stays open"
    )
    body_timeout: float = Field(
        default=30.0, gt=0, description="s a request body may stall, or a response go unread"
    )
    read_timeout: float = Field(
        default=30.0, gt=0, description="s a machine's response body may stall"
    )
    upstream_connect_timeout: float = Field(
        default=2.0, gt=0, description="s to connect to a machine"
    )
    upstream_response_timeout: float = Field(
        default=60.0, gt=0, description="s from a request sent to its response head"
    )
    upstream_idle_timeout: float = Field(
        default=30.0, gt=0, description="s an idle pooled machine connection is kept"
    )
    max_connections: int = Field(default=10_000, ge=1, description="client connections at once")
    max_connections_per_client: int = Field(
        default=512, ge=1, description="client connections at once from one address"
    )
    pool_size_per_backend: int = Field(
        default=64, ge=0, description="idle connections kept per machine"
    )
    max_connections_per_machine: int = Field(
        default=256,
        ge=1,
        description="connections the edge opens to one machine at most, busy and idle (a "
        "request that finds its machine at the cap waits upstream_connect_timeout for one, "
        "then gets 503)",
    )
    max_retries: int = Field(
        default=2, ge=0, description="other machines tried for a GET/HEAD that was refused"
    )
    buffer_bytes: int = Field(
        default=64 * 1024, ge=1024, description="request body buffered before a machine is ready"
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="networks (CIDRs or addresses, comma-separated) of the hops in front of "
        "the edge (a load balancer, a CDN) whose X-Forwarded-For, Forwarded, X-Forwarded-Proto "
        "and X-Forwarded-Host it keeps, appending to their chain as a proxy does; from any "
        "other client, forwarding headers are dropped and the edge writes its own from the "
        "connection. None by default",
    )
    token_cache_ttl: float = Field(
        default=GRANT_TTL,
        gt=0,
        le=60,
        description="s an answer of flaps about a token (a pin's nonomad-token, verified by "
        "flaps: the edge holds no root keys) is kept: how late a revocation may be honoured",
    )

    @field_validator("http_listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for network in value:
            try:
                ip_network(network.strip())
            except ValueError as exc:
                raise ValueError(f"{network!r} is not a network: {exc}") from None
        return value

    @field_validator("flaps")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value)
        return value

    @field_validator("domain")
    @classmethod
    def _domain(cls, value: str) -> str:
        value = value.strip(".").lower()
        labels = value.split(".")
        if not value or len(value) > 253 or not all(is_name(label) for label in labels):
            raise ValueError(f"{value!r} is not a domain name")
        return value

    @field_validator("region")
    @classmethod
    def _region(cls, value: str) -> str:
        if not is_name(value):
            raise ValueError("must be 1-63 lowercase letters, digits or dashes")
        return value

    def trusted_networks(self) -> tuple[Network, ...]:
        return tuple(ip_network(network.strip()) for network in self.trusted_proxies)

    def limits(self) -> Limits:
        return Limits(**{f.name: getattr(self, f.name) for f in fields(Limits)})

    def router_config(self) -> RouterConfig:
        return RouterConfig(
            region=self.region,
            queue_wait=self.queue_wait,
            cold_start_timeout=self.cold_start_timeout,
            idle_timeout=self.idle_timeout,
            autostop_interval=self.autostop_interval,
            unhealthy_for=self.unhealthy_for,
            probe_timeout=self.probe_timeout,
            probe_interval=self.probe_interval,
            check_concurrency=self.check_concurrency,
        )
