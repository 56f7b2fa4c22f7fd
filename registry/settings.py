"""Settings of a registry replica: which workers to follow, which replicas to share with.

`ReplicaSettings` is what every service that embeds a replica (flaps, the proxy) and the
standalone registry have in common; `RegistrySettings` is the standalone registry's.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from registry.replica import Replica
from runtime import ServiceSettings, aio_channel, parse_host_port
from runtime.clock import Clock

FOLLOWS_PER_CALLER = 64
"""Default of --follows-per-caller: the Follow streams one caller (a certificate's name, or a
host) may have open at once; each holds a queue and is sent the whole view first."""


class ReplicaSettings(ServiceSettings):
    """The settings of an embedded or standalone registry replica."""

    workers: list[str] = Field(
        default_factory=list,
        description="seed worker addresses host:port; each is asked who it is, then followed "
        "(more workers join at runtime through Announce and peers)",
    )
    peers: list[str] = Field(
        default_factory=list,
        description="other replicas (registry, flaps, proxy) whose members are merged in",
    )
    upstream: str | None = Field(
        default=None,
        description="follow this replica's Follow stream instead of every worker",
    )
    suspect_after: float = Field(
        default=0.6, gt=0, description="seconds without a heartbeat before a worker is suspect"
    )
    dead_after: float = Field(
        default=1.0, gt=0, description="seconds without a heartbeat before a worker is dead"
    )
    retry_max: float = Field(default=2.0, ge=0.05, description="longest reconnect backoff, seconds")
    follows_per_caller: int = Field(
        default=FOLLOWS_PER_CALLER,
        gt=0,
        description="Follow streams of this replica one caller (a certificate's name, or a "
        "host) may have open at once; one more is RESOURCE_EXHAUSTED",
    )
    forget_after: float = Field(
        default=600.0,
        gt=0,
        description="seconds a worker stays dead before it is forgotten with its rows",
    )

    @field_validator("workers", "peers")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for address in value:
            parse_host_port(address)
        return value

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value)
        return value

    @model_validator(mode="after")
    def _timeouts_in_order(self) -> Self:
        """suspect_after < dead_after < forget_after. When one of a pair was left at its
        default, the message blames the one the user set and says how to fix it."""
        given = self.model_fields_set
        for low, high in (("suspect_after", "dead_after"), ("dead_after", "forget_after")):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo < hi:
                continue

            def said(name: str, value: float) -> str:
                flag = "--" + name.replace("_", "-")
                return f"{flag} {value:g}" if name in given else f"{name} {value:g}s (its default)"

            if high in given and low not in given:
                fix = f"pass a {high} above {lo:g}, or lower {low} with --{low.replace('_', '-')}"
            else:
                fix = f"pass a {low} below {hi:g}, or raise {high} with --{high.replace('_', '-')}"
            raise ValueError(
                f"{low} must be less than {high}: {said(low, lo)} is not below "
                f"{said(high, hi)}; {fix}"
            )
        return self

    def replica(self, clock: Clock | None = None) -> Replica:
        """A Replica with these settings; `registry.service.serve_replica` adds the workers.
        With cluster_ca, it reaches workers and other replicas over the cluster's mutual TLS.
        `clock`: its heartbeats' time (the system's by default; a simulated node's own)."""
        tls = self.cluster_tls
        return Replica(
            clock=clock,
            channel=lambda address: aio_channel(address, tls=tls),
            suspect_after=self.suspect_after,
            dead_after=self.dead_after,
            upstream=self.upstream,
            peers=self.peers,
            retry_max=self.retry_max,
            forget_after=self.forget_after,
        )


class RegistrySettings(ReplicaSettings):
    """Settings of one standalone registry replica (env prefix `REGISTRY_`)."""

    model_config = SettingsConfigDict(env_prefix="REGISTRY_")
