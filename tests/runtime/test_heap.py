"""runtime.heap: a process whose cycle collector never walks its old objects (in a child
process: the policy is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import gc, json
    from runtime.heap import no_full_collections

    class Node:
        def __init__(self):
            self.me = self  # a reference cycle: only the cycle collector frees it

    no_full_collections()
    kept = [Node() for _ in range(50_000)]  # what the service holds (a view)
    gen2 = []
    gc.callbacks.append(lambda phase, info: phase == "stop" and gen2.append(info))
    young = [Node() for _ in range(1_000)]
    del young  # cycles that die young
    gc.collect(1)
    collected_young = gen2[-1]["collected"]
    old = Node()
    gc.collect()  # what would be a full collection: it freezes instead
    del old  # a cycle that dies once frozen: never collected
    gc.collect()
    print(json.dumps({
        "thresholds": gc.get_threshold(),
        "collected_young": collected_young,
        "full_collected": gen2[-1]["collected"],
        "frozen": gc.get_freeze_count(),
        "kept": len(kept),
    }))
    """
)


def test_full_collections_walk_nothing_and_young_cycles_are_still_collected() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    got = json.loads(out.stdout)
    assert got["thresholds"] == [500, 4, 10]
    assert got["collected_young"] >= 1_000  # young garbage in cycles goes as before
    assert got["full_collected"] == 0  # the full collection had nothing to walk
    assert got["frozen"] >= got["kept"]  # the old objects are frozen, not walked
