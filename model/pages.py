"""Answers that carry machines, cut to fit a gRPC message whatever the machines hold.

gRPC refuses to send (and clients to receive, 4 MiB by default) a message over its limit, so
an answer that grows with the fleet or with what tenants put in their configs must come in
pieces: a list answer in pages (`page`, for flyd's and flaps' ListMachines), a WatchEvents
snapshot in parts (`snapshot_parts`, for flyd's stream and a replica's Follow). Each piece
holds at most `PAGE_BYTES` of encoded machines, and always at least one machine, so a
follower never stalls on a large row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2
from runtime.errors import InvalidArgument

PAGE_BYTES = 1 << 20
"""Encoded machines in one page or snapshot part: a quarter of gRPC's default 4 MiB."""
DEFAULT_PAGE_SIZE = 500
MAX_PAGE_SIZE = 1000


def checked_page_size(page_size: int) -> int:
    """A request's page size, checked: `page_size`, or `DEFAULT_PAGE_SIZE` for 0."""
    if page_size < 0 or page_size > MAX_PAGE_SIZE:
        raise InvalidArgument("page_size", f"must be between 0 and {MAX_PAGE_SIZE}")
    return page_size or DEFAULT_PAGE_SIZE


def page(
    machines: Iterable[pb.Machine], page_size: int, page_token: str
) -> tuple[list[pb.Machine], str]:
    """One page of `machines` in id order, after `page_token` (the last id of the page before,
    "" for the first), and the token of the next page ("" after the last).

    At most `page_size` machines (0: `DEFAULT_PAGE_SIZE`) and `PAGE_BYTES` of them. Machines
    created or destroyed between two pages may be missed or seen on both sides, never twice
    on one page.
    """
    size = checked_page_size(page_size)
    rest = sorted((m for m in machines if m.id > page_token), key=lambda m: m.id)
    out: list[pb.Machine] = []
    used = 0
    for machine in rest:
        cost = machine.ByteSize() + 8
        if out and (len(out) == size or used + cost > PAGE_BYTES):
            return out, out[-1].id
        out.append(machine)
        used += cost
    return out, ""


def snapshot_parts(
    seq: int, reason: str, machines: Iterable[pb.Machine]
) -> Iterator[worker_pb2.Snapshot]:
    """The snapshot of `machines` at `seq` in parts of at most `PAGE_BYTES` of machines: `part`
    counts from 0, every part but the last has `more` set. An empty snapshot is one part."""
    part = worker_pb2.Snapshot(seq=seq, reason=reason)
    used = 0
    for machine in machines:
        cost = machine.ByteSize() + 8
        if part.machines and used + cost > PAGE_BYTES:
            part.more = True
            yield part
            part = worker_pb2.Snapshot(seq=seq, reason=reason, part=part.part + 1)
            used = 0
        part.machines.append(machine)
        used += cost
    yield part
