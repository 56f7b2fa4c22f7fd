"""Keeping CPython's cycle collector from holding a service's event loop.

The collector walks every object of the generation it collects: the young ones often and
quickly, the oldest one (everything that lived long: a replica's view of a fleet, a worker's
rows, the modules) now and then, at about a microsecond an object on these hosts. With a view
of 10,000 workers that is a tenth of a second during which the loop answers nobody, and the
young collections, with the default thresholds, reach 2-3 ms.

`no_full_collections` is a policy for the whole process, so each service's `main` decides to
apply it (flyd, flaps, the proxy and the registry do): the young generations are kept small
(a collection of them walks a few thousand objects: well under a millisecond), and whenever the
collector would walk the oldest generation, what survived so far is frozen instead
(`gc.freeze`: kept, never walked again), so the full collection has nothing to walk.

The price is a reference cycle that becomes garbage after it was frozen: it is never
collected (reference counting still frees everything that is not in a cycle, and most cycles
die young, in the young collections). The flaps benchmark measures what is left at the end
of its 10,000-worker run: a few hundred objects, as many as without the policy.
`nonomad_gc_frozen_objects` shows the frozen heap growing.
"""

from __future__ import annotations

import gc

from prometheus_client import Gauge

__all__ = ["no_full_collections"]

# Young collections every 500 allocations of tracked objects, the middle one every 4 of those:
# each walks at most a few thousand objects (defaults: 700 and 10).
YOUNG_THRESHOLD = 500
MIDDLE_THRESHOLD = 4
# Middle collections before the oldest is due (as CPython's default): here, a freeze.
OLD_THRESHOLD = 10

FROZEN = Gauge(
    "nonomad_gc_frozen_objects",
    "Objects the garbage collector no longer walks (frozen in place of its full collections).",
)


def _freeze_before_full(phase: str, info: dict[str, int]) -> None:
    if phase == "start" and info["generation"] == 2:
        gc.freeze()


def no_full_collections() -> None:
    """From now on the process never walks its old objects: see the module's docstring.
    What is alive now (the modules, the settings, whatever `main` made) is frozen at once."""
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD)
    if _freeze_before_full not in gc.callbacks:
        # First: a callback after it sees the collection as it happens (of what is young).
        gc.callbacks.insert(0, _freeze_before_full)
    gc.freeze()
    FROZEN.set_function(gc.get_freeze_count)
