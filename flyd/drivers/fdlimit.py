"""The descriptor limit of flyd (and the netd it starts), raised at start as far as the host
allows, and how many machines fit in it.

Each machine costs flyd descriptors for as long as it lives: the pidfds of its wrapper and its
log's copier, and, while it is stopped, the sockets of the host ports it publishes (the process
driver holds them); netd holds more (its namespaces, its ports, two per forwarded connection).
Processes start with a soft limit of 1024 on most hosts: a worker would run out after some tens
of machines, and then every machine's next start or connection fails alike. So flyd raises its
soft limit to its hard one at start (netd, which flyd starts, inherits it), and takes no more
machines than its limit holds at their most (`machines_within`): a machine is refused at
create, as when memory runs out, instead of one machine's ports starving the others.
"""

from __future__ import annotations

import resource

__all__ = ["FDS_BASE", "FDS_PER_MACHINE", "machines_within", "raise_nofile"]

FDS_BASE = 512
"""What flyd holds whatever its machines: its log, listeners and clients, images being read,
threads' files, its connection to netd."""
FDS_PER_MACHINE = 2
"""A machine's own, besides one per published port: the pidfds of its wrapper and copier."""


def raise_nofile() -> int:
    """Raise this process's descriptor limit as far as the host allows: soft and hard to
    fs.nr_open for a process that may raise its hard limit (root with CAP_SYS_RESOURCE), else
    the soft limit to the hard one. Returns the soft limit now; never lowers it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = _nr_open()
    for wanted in sorted({max(_nr_open(), hard), hard}, reverse=True):
        if soft != resource.RLIM_INFINITY and soft >= wanted:
            return soft
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
        except (OSError, ValueError):
            continue
        return wanted
    return soft


def machines_within(limit: int, machines: int, *, ports: int) -> int:
    """How many of `machines` fit a descriptor limit of `limit`, each at its most: with
    `ports` published ports (the most a config may have)."""
    return max(0, min(machines, (limit - FDS_BASE) // (FDS_PER_MACHINE + ports)))


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20
