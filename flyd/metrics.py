"""flyd's Prometheus metrics, in prometheus_client's default registry.

The runtime serves that registry at `/metrics` when flyd runs with `--metrics-listen`. What
changes on every step is a counter bumped in the commit path (a cached child per label pair,
so a step costs one increment); what describes the worker as a whole (machines by state,
reservations, capacity) is read from the worker's running totals when Prometheus scrapes, so
the create path pays nothing for it.

Metrics observe; they are not called back. The runner imports this module to count its
transitions and the worker to time its creates; this module sees the worker only as
`WorkerTotals`, the few totals the gauges read, and never imports flyd.worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flyd import fsm
from flyd.settings import CapacitySettings
from flyd.v1 import machine_pb2 as pb

__all__ = [
    "CLEANUP_FAILURES",
    "CREATE_SECONDS",
    "FENCED",
    "LOG_TRANSACTION_COMMITS",
    "SUPERSEDED",
    "WorkerCollector",
    "WorkerTotals",
    "count_transition",
    "register_worker",
]

TRANSITIONS = Counter(
    "nonomad_flyd_state_transitions",
    "Committed machine state changes on this worker, by the states left and entered.",
    ["from_state", "to_state"],
)
CREATE_SECONDS = Histogram(
    "nonomad_flyd_create_seconds",
    "CreateMachine handled by the worker: from the request to the machine's resting state "
    "(started, or created with skip_launch).",
    buckets=(0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
LOG_TRANSACTION_COMMITS = Histogram(
    "nonomad_flyd_log_transaction_commits",
    "Commits written in one transaction (one fsync) of the machine log: operations that came "
    "while the one before was written share the next (flyd.commits).",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
CLEANUP_FAILURES = Counter(
    "nonomad_flyd_cleanup_failures",
    "Cleanups after a destroy that failed (each is retried with a backoff, then given up).",
)

FENCED = Counter(
    "nonomad_flyd_fenced",
    "Slot primaries fenced because the worker came back (a restart, a freeze): unroutable until "
    "the other members confirmed them.",
)
SUPERSEDED = Counter(
    "nonomad_flyd_superseded",
    "Machines found outranked in their slot (the standby took over): stopped and made standbys.",
)

_transition_children: dict[tuple[int, int], Counter] = {}


def count_transition(from_state: int, to_state: int) -> None:
    """Count one committed change of state (a step within one state is not counted)."""
    child = _transition_children.get((from_state, to_state))
    if child is None:
        child = TRANSITIONS.labels(fsm.state_name(from_state), fsm.state_name(to_state))
        _transition_children[(from_state, to_state)] = child
    child.inc()


# Every state a machine can rest in is reported, zero or not, so a series never vanishes.
_STATES = [value for value in pb.MachineState.values() if value != pb.MACHINE_STATE_UNSPECIFIED]
_RESOURCES = ("cpu_millicores", "memory_mib", "disk_mib", "machines")


class WorkerTotals(Protocol):
    """What the worker gauges read: the running totals a worker keeps (`flyd.worker.Worker`)."""

    @property
    def total(self) -> CapacitySettings:
        """What the worker offers in all."""
        ...

    @property
    def cordoned(self) -> bool:
        """Whether the worker refuses new machines."""
        ...

    def machines_by_state(self) -> dict[int, int]:
        """How many machines are in each state."""
        ...

    def reserved(self) -> pb.Resources:
        """What the worker's machines (and creates under way) reserve."""
        ...


class WorkerCollector(Collector):
    """Gauges computed at scrape time from the worker's running totals."""

    def __init__(self, worker: WorkerTotals) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self._worker
        machines = GaugeMetricFamily(
            "nonomad_flyd_machines", "Machines on this worker by state.", labels=["state"]
        )
        by_state = worker.machines_by_state()
        for state in _STATES:
            machines.add_metric([fsm.state_name(state)], by_state.get(state, 0))
        yield machines

        reserved = worker.reserved()
        total = worker.total
        reserved_family = GaugeMetricFamily(
            "nonomad_flyd_reserved",
            "Resources reserved by the machines that are not destroyed (and creates under way).",
            labels=["resource"],
        )
        capacity_family = GaugeMetricFamily(
            "nonomad_flyd_capacity", "Resources this worker offers in all.", labels=["resource"]
        )
        for resource in _RESOURCES:
            reserved_family.add_metric([resource], getattr(reserved, resource))
            capacity_family.add_metric([resource], getattr(total, resource))
        yield reserved_family
        yield capacity_family
        yield GaugeMetricFamily(
            "nonomad_flyd_cordoned",
            "1 while the worker refuses new machines.",
            value=1 if worker.cordoned else 0,
        )


def register_worker(worker: WorkerTotals) -> WorkerCollector:
    """Report `worker`'s gauges from the default registry (one worker per process)."""
    collector = WorkerCollector(worker)
    REGISTRY.register(collector)
    return collector
