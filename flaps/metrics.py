"""flaps' Prometheus metrics (default registry; served with `--metrics-listen`).

    nonomad_flaps_placements_total{region, outcome}
        One per region a create tried: `placed` (a worker there took it), `exhausted` (no worker
        there would: the create moved on to the next region or failed), `failed` (a worker
        answered with an error that ends the create).
    nonomad_flaps_rejections_total{reason}
        Workers passed over, by the placement stage's reason (`insufficient_memory`,
        `cordoned`, `dead`, ...) or, for a claim the worker refused, `refused`/`unreachable`.
    nonomad_flaps_claims_total{outcome}
        Claims sent to workers: `accepted`, `refused`, `unreachable`, `failed`.
    nonomad_flaps_fallbacks_total{to}
        A create moving on after a refusal: `next_worker` (to the next ranked candidate),
        `next_region` (to the next region it named).

Label values are bounded: regions are validated against the fleet, reasons and outcomes are
fixed names.
"""

from __future__ import annotations

from typing import Literal

from prometheus_client import Counter

from flaps.placement import Decision

__all__ = ["Claim", "Outcome", "claimed", "concluded", "fell_back"]

Outcome = Literal["placed", "exhausted", "failed"]
Claim = Literal["accepted", "refused", "unreachable", "failed"]

PLACEMENTS = Counter(
    "nonomad_flaps_placements",
    "Regions tried by creates, by outcome (placed, exhausted, failed).",
    ["region", "outcome"],
)
REJECTIONS = Counter(
    "nonomad_flaps_rejections",
    "Workers passed over for a create, by the reason placement or the worker gave.",
    ["reason"],
)
CLAIMS = Counter(
    "nonomad_flaps_claims",
    "Claims sent to workers, by the worker's answer (accepted, refused, unreachable, failed).",
    ["outcome"],
)
FALLBACKS = Counter(
    "nonomad_flaps_fallbacks",
    "Creates moving on after a refusal: to the next ranked worker or the next named region.",
    ["to"],
)


def concluded(decision: Decision, outcome: Outcome) -> None:
    """Count a region's decision once its claims are done (its rejections are final then)."""
    PLACEMENTS.labels(decision.region, outcome).inc()
    for reason, n in decision.counts().items():
        REJECTIONS.labels(reason).inc(n)


def claimed(outcome: Claim) -> None:
    CLAIMS.labels(outcome).inc()


def fell_back(to: Literal["next_worker", "next_region"]) -> None:
    FALLBACKS.labels(to).inc()
