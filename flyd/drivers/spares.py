"""A driver's spares: run dirs and cgroups made ahead of need (see `Spares`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import structlog

__all__ = ["SPARES", "Spares"]

log = structlog.get_logger(__name__)

# Spare run dirs (under the run root) and cgroups (beside the machines'), made ahead of need.
_SPARE_DIR = ".spare"
_SPARE_CGROUP = ".spare-"
SPARES = 8


class Spares:
    """Run dirs and cgroups made ahead of need, so a machine's first start renames a set into
    place instead of making directories and files while its caller waits (each a journalled or
    cgroup-locked operation that takes long on a busy host: 0.02-0.9 ms a file here).

    A worker thread makes them, up to `SPARES` at a time. Their names say which run root they
    belong to, so a driver on the same run root removes what a dead one left (in that thread,
    before it makes any: not while flyd starts); `close` removes the rest. Taking one is a
    rename, which fails harmlessly onto anything that exists: `claim` picks a set on the
    event loop, `take` renames it, in a thread if the caller likes (a cgroup rename waits for
    any cgroup move under way on the host: up to an RCU grace period).
    """

    def __init__(
        self,
        run_root: Path,
        cgroup_parents: list[Path],
        user: tuple[int, int, list[int]] | None,
        layout: Callable[[Path], None] | None = None,
        cgroup_namespace: Callable[[list[Path]], int] | None = None,
    ) -> None:
        """`layout`: makes what else a driver wants in each spare run dir (in the thread);
        `cgroup_namespace(cgroups)`: a descriptor of a namespace rooted at a spare set's
        cgroups (`namespace`), which stays rooted there across the rename into place."""
        self._root = run_root / _SPARE_DIR
        self._layout = layout
        self._cgroup_namespace = cgroup_namespace
        # token -> (namespace descriptor, its cgroups' inodes, which a rename keeps)
        self._namespaces: dict[str, tuple[int, list[int]]] = {}
        self._cgroup_parents = cgroup_parents  # one per controller, in CONTROLLERS order
        self._user = user
        self._tag = hashlib.blake2s(str(run_root).encode(), digest_size=4).hexdigest()
        self._ready: collections.deque[str] = collections.deque()
        self._making: asyncio.Future[None] | None = None
        # Set here, cleared by the thread as it ends: back-to-back starts that never yield to
        # the event loop (which would run the future's callbacks) must still see it is done.
        self._busy = False
        self._closed = False
        self._swept = False  # what a driver on this run root left when it died is gone

    @property
    def ready(self) -> int:
        """How many spare sets are ready to take."""
        return len(self._ready)

    def claim(self) -> str | None:
        """A ready spare set, kept for the caller's `take`; None if none is ready. Called on
        the event loop (it starts making more); the `take` may run in any thread.
        """
        self._refill()
        token = self._ready.popleft() if self._ready else None
        self._refill()
        return token

    def take(self, token: str, run_dir: Path, cgroups: list[Path]) -> list[bool] | None:
        """Move the claimed spare set `token` to `run_dir` and `cgroups`; None if `run_dir`
        exists (the set goes back to the ready ones). Else, per cgroup, whether it is a new
        one (False: it existed, left as it was). Any thread: it only renames.
        """
        try:
            os.rename(self._root / token, run_dir)
        except OSError:
            self._ready.appendleft(token)  # the machine has a run dir: not a first start
            return None
        fresh = []
        for parent, cg in zip(self._cgroup_parents, cgroups, strict=True):
            spare = parent / f"{_SPARE_CGROUP}{self._tag}-{token}"
            try:
                os.rename(spare, cg)
                fresh.append(True)
            except OSError:
                with contextlib.suppress(OSError):
                    spare.rmdir()
                fresh.append(False)
        return fresh

    def _refill(self) -> None:
        if self._closed or self._busy or len(self._ready) >= SPARES:
            return
        self._busy = True
        loop = asyncio.get_running_loop()
        self._making = loop.run_in_executor(None, self._make, SPARES - len(self._ready))
        self._making.add_done_callback(self._made)

    def _made(self, future: asyncio.Future[None]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("spare_run_dirs_failed", error=str(future.exception()))
            return  # the next start tries again
        self._refill()  # some were taken meanwhile

    def _make(self, count: int) -> None:
        """In a worker thread: make `count` spare sets."""
        try:
            if not self._swept:
                self._remove_all()
                self._swept = True
            self._root.mkdir(mode=0o755, exist_ok=True)
            for _ in range(count):
                if self._closed:
                    return
                token = secrets.token_hex(6)
                run_dir = self._root / token
                os.mkdir(run_dir, 0o755)
                os.mkdir(run_dir / "status", 0o700)
                if self._user is not None:
                    os.chown(run_dir / "status", self._user[0], self._user[1])
                if self._layout is not None:
                    self._layout(run_dir)
                cgroups = [p / f"{_SPARE_CGROUP}{self._tag}-{token}" for p in self._cgroup_parents]
                for cg in cgroups:
                    os.mkdir(cg, 0o755)
                if self._cgroup_namespace is not None and cgroups:
                    try:
                        fd = self._cgroup_namespace(cgroups)
                    except OSError as e:  # the start makes its own
                        log.debug("spare_cgroup_namespace_failed", error=str(e))
                    else:
                        self._namespaces[token] = (fd, [os.stat(cg).st_ino for cg in cgroups])
                self._ready.append(token)
        finally:
            self._busy = False

    def namespace(self, token: str) -> tuple[int, list[int]] | None:
        """The cgroup namespace made with the claimed set `token` (the caller's to close) and
        the inodes of the cgroups it is rooted at (the caller checks they are the machine's
        now: `take` may have found the machine's own in place); None if none was made."""
        return self._namespaces.pop(token, None)

    async def close(self) -> None:
        """Stop making spares and remove the ones not taken."""
        self._closed = True
        if self._making is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._making)
        self._remove_all()

    def _remove_all(self) -> None:
        self._ready.clear()
        while self._namespaces:
            fd, _ = self._namespaces.popitem()[1]
            os.close(fd)
        shutil.rmtree(self._root, ignore_errors=True)
        ours = f"{_SPARE_CGROUP}{self._tag}-"
        for parent in self._cgroup_parents:
            with contextlib.suppress(OSError), os.scandir(parent) as entries:
                for entry in entries:
                    if entry.name.startswith(ours):
                        with contextlib.suppress(OSError):
                            os.rmdir(entry.path)
