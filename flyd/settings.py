"""flyd's settings: who the worker is, what it has, where it keeps things."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from runtime import ServiceSettings


class CapacitySettings(BaseModel):
    """What this worker offers. Reservations never exceed it."""

    model_config = {"extra": "forbid"}

    cpu_millicores: int = Field(default=4000, gt=0, description="CPU to hand out, millicores")
    memory_mib: int = Field(default=4096, gt=0, description="memory to hand out, MiB")
    disk_mib: int = Field(default=20480, ge=0, description="scratch disk to hand out, MiB")
    machines: int = Field(default=1000, gt=0, description="most machines (not destroyed)")


def parse_port_range(value: str) -> range:
    low, sep, high = value.partition("-")
    if not sep or not low.isdigit() or not high.isdigit():
        raise ValueError(f"expected LOW-HIGH, got {value!r}")
    lo, hi = int(low), int(high)
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"ports must satisfy 1024 <= LOW <= HIGH <= 65535, got {value!r}")
    return range(lo, hi + 1)


LOG_READ_BYTES = 1 << 20
"""Default of --log-read-bytes: the most of a machine's log one GetMachineLogs reads."""
STREAMS_PER_CALLER = 1024
"""Default of --streams-per-caller (flaps relays every client's streams as one caller)."""

MAX_WORKER_ID = 63 - 13  # room for "-" and the 12 hex digits of a machine id


class FlydSettings(ServiceSettings):
    """Settings of one flyd (one worker)."""

    model_config = SettingsConfigDict(env_prefix="FLYD_")

    worker_id: str = Field(
        default_factory=lambda: socket.gethostname().split(".")[0].lower(),
        description="this worker's id, unique in the fleet",
    )
    region: str = Field(default="local", description="region this worker belongs to")
    data_dir: Path = Field(default=Path(".nonomad/flyd"), description="LMDB log, runs, cache")
    image_source: Path = Field(
        default=Path(".nonomad/images"),
        description="directory of OCI image layouts (or tars of them) to pull from",
    )
    image_cache_bytes: int = Field(default=4 << 30, gt=0, description="image cache bound")
    capacity: CapacitySettings = CapacitySettings()
    ports: str = Field(default="20000-20999", description="host ports for machine services")
    machine_host: str = Field(
        default="",
        description="host machines' published ports are on, as others dial them (default: the "
        "host of --advertise, else of --listen; 127.0.0.1 when that is a wildcard)",
    )
    advertise: str | None = Field(
        default=None, description="address others reach this worker at (default: bound address)"
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="placement labels (flyd adds nonomad.egress=true when its machines can get "
        "out; that one is its own)",
    )
    announce: list[str] = Field(
        default_factory=list,
        description="registry replicas (registry, flaps or proxy addresses) to announce to",
    )
    announce_interval: float = Field(default=5.0, gt=0, description="s between announcements")
    driver: Literal["auto", "oci", "process"] = Field(
        default="auto",
        description="how machines run: oci (crun containers), process (host processes), or "
        "auto (oci where this host can run it, else process)",
    )
    network: str = Field(
        default="10.87.0.0/20",
        description="this worker's private IPv4 prefix: each oci machine gets an address in it",
    )
    egress_via: Path | None = Field(
        default=None,
        description="the uplink of this worker's oci machines that ask for egress: a network "
        "namespace of the operator's (/run/netns/NAME, `ip netns add NAME`), never the host's "
        "own; without it no machine has egress",
    )
    route_machines: bool = Field(
        default=False,
        description="reach each oci machine at its own address from this host's network: netd "
        "links the worker's hub to the host (a veth, the route of --network into the hub; only "
        "TCP to published services crosses it), so a proxy on any host that routes --network "
        "to this one dials machine:internal_port (docs/deploy.md); off, services are reached "
        "at their host ports",
    )
    uid_base: int = Field(
        default=1 << 30,
        description="first host uid of the oci machines' ranges (65536 uids each)",
    )
    run_as: str | None = Field(
        default=None, description="unprivileged user for machines (process driver)"
    )
    cgroup_root: Path = Field(default=Path("/sys/fs/cgroup"), description="cgroup v1 mount")
    cgroup_prefix: str = Field(default="nonomad", description="cgroup folder for machines")
    heartbeat_interval: float = Field(default=0.2, gt=0, description="WatchEvents heartbeat, s")
    fence_after: float = Field(
        default=0.5,
        gt=0,
        description="s away (frozen, starved) after which flyd fences its slot primaries until "
        "the other members confirm them; at most the proxies' suspect_after",
    )
    ready_grace: float = Field(
        default=10.0,
        ge=0,
        description="s after a start before a machine whose ports or checks still fail shows why",
    )
    ready_settle: float = Field(
        default=1.0, ge=0, description="s a machine with no services or checks runs to be ready"
    )
    restart_window: float = Field(default=300.0, gt=0, description="restart counting window, s")
    restart_max_retries: int = Field(default=10, gt=0, description="default on-failure retries")
    log_max_bytes: int = Field(default=1 << 20, gt=0, description="machine log size to rotate at")
    log_backups: int = Field(
        default=2, ge=0, description="rotated files of each machine log kept beside it"
    )
    log_read_bytes: int = Field(
        default=LOG_READ_BYTES,
        gt=0,
        description="most bytes of a machine's log one GetMachineLogs reads for its tail, "
        "however large the log: the first line says how much was left out",
    )
    streams_per_caller: int = Field(
        default=STREAMS_PER_CALLER,
        gt=0,
        description="GetMachineLogs follow streams, WaitMachine calls and WatchEvents streams "
        "one caller (a certificate's name, or a host) may have open at once, each kind counted "
        "apart; one more is RESOURCE_EXHAUSTED (flaps relays all its clients' as one caller)",
    )
    log_keep: int = Field(default=10_000, gt=0, description="log records kept behind snapshots")

    @model_validator(mode="after")
    def _machine_host_follows_advertise(self) -> FlydSettings:
        # A worker told its address once advertises it for its machines too: a proxy on
        # another host must never be handed a loopback address to dial.
        if not self.machine_host:
            host = (self.advertise or self.listen).rpartition(":")[0].strip("[]")
            wildcard = host in ("", "0.0.0.0", "::")
            self.machine_host = "127.0.0.1" if wildcard else host
        return self

    @model_validator(mode="after")
    def _one_way_out(self) -> FlydSettings:
        if self.route_machines and self.egress_via is not None:
            raise ValueError(
                "route_machines: not together with egress_via yet (each is the way out of the "
                "worker's hub: its default route)"
            )
        return self

    @field_validator("worker_id", "region")
    @classmethod
    def _name(cls, value: str) -> str:
        from runtime.validate import is_name

        if not is_name(value):
            raise ValueError("must be 1-63 lowercase letters, digits or dashes")
        return value

    @field_validator("worker_id")
    @classmethod
    def _machine_ids_fit(cls, value: str) -> str:
        # A machine's id is `<worker id>-<12 hex>` and an id is at most 63 characters.
        if len(value) > MAX_WORKER_ID:
            raise ValueError(
                f"at most {MAX_WORKER_ID} characters: its machines' ids are "
                "`<worker id>-<12 hex>`, at most 63"
            )
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        from model.validate import DISK_LABEL, EGRESS_LABEL

        if EGRESS_LABEL in value:
            raise ValueError(
                f"{EGRESS_LABEL} is flyd's own: it says whether machines here can have egress "
                "(--egress-via)"
            )
        if DISK_LABEL in value:
            raise ValueError(
                f"{DISK_LABEL} is flyd's own: it says whether machines' disks are limited here "
                "(the oci driver)"
            )
        return value

    @field_validator("network")
    @classmethod
    def _network(cls, value: str) -> str:
        import ipaddress

        net = ipaddress.IPv4Network(value)  # a ValueError names what is wrong
        if not net.is_private or net.num_addresses < 4:
            raise ValueError("must be a private IPv4 prefix of at least 4 addresses")
        return value

    @field_validator("egress_via")
    @classmethod
    def _egress_via(cls, value: Path | None) -> Path | None:
        from flyd.drivers.namespaces import network_namespace_problem

        if value is not None and (problem := network_namespace_problem(str(value))) is not None:
            raise ValueError(problem)
        return value

    @field_validator("uid_base")
    @classmethod
    def _uid_base(cls, value: int) -> int:
        if value < 65536 or value % 65536 or value + 65536 > 2**32 - 1:
            raise ValueError("must be a positive multiple of 65536 below 2^32")
        return value

    @field_validator("ports")
    @classmethod
    def _ports(cls, value: str) -> str:
        parse_port_range(value)
        return value

    def port_range(self) -> range:
        return parse_port_range(self.ports)
