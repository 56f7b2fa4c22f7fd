"""The deadline every data-plane connection keeps (`Timed`), on one lazily re-armed timer.

Each phase of a connection only moves the deadline; the timer, when it fires, re-arms itself if
the deadline moved on, so moving the deadline later costs no timer call.
"""

from __future__ import annotations

import asyncio
import math


class Timed(asyncio.Protocol):
    __slots__ = ("_deadline", "_loop", "_timer", "_timer_at")

    _loop: asyncio.AbstractEventLoop
    _deadline: float
    _timer: asyncio.TimerHandle | None
    _timer_at: float

    def _init_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._deadline = math.inf
        self._timer = None
        self._timer_at = math.inf

    def _set_deadline(self, delay: float) -> None:
        self._set_deadline_at(self._loop.time() + delay)

    def _set_deadline_at(self, deadline: float, slack: float = 0.0) -> None:
        """Expire at `deadline`, or up to `slack` seconds after it when that spares moving
        the timer already armed (an idle pooled connection may well linger a little)."""
        self._deadline = deadline
        timer = self._timer
        if timer is None:
            self._timer = self._loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline
        elif deadline + slack < self._timer_at:
            timer.cancel()
            self._timer = self._loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline

    def _clear_deadline(self) -> None:
        self._deadline = math.inf

    def _stop_timer(self) -> None:
        self._deadline = math.inf
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline == math.inf:
            return
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline
            return
        self._deadline = math.inf
        self._expired()

    def _expired(self) -> None:
        raise NotImplementedError
