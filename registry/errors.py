"""The registry's errors, translated to gRPC status codes in one place (registry.service)."""

from __future__ import annotations

from runtime import errors as runtime_errors


class RegistryError(Exception):
    """Base of every error the registry reports.

    `retryable` says whether the same call may succeed later without changes.
    """

    retryable = False


class InvalidArgument(RegistryError, runtime_errors.InvalidArgument):
    """A field is missing or malformed; `field` names it (as in the request: `worker.address`)."""

    def __init__(self, field: str, message: str) -> None:
        runtime_errors.InvalidArgument.__init__(self, field, message)


class Unavailable(RegistryError):
    """The replica is shutting down or not running."""

    retryable = True


class SequenceGap(RegistryError):
    """A worker's stream skipped changes: the follower must resume from the last applied seq.

    Never seen with a well-behaved worker (its changes are consecutive); it exists so that a
    broken stream makes the replica re-follow instead of silently missing rows.
    """

    retryable = True

    def __init__(self, worker_id: str, applied: int, got: int) -> None:
        super().__init__(
            f"worker {worker_id}: change seq {got} does not follow the applied seq {applied}"
        )
        self.worker_id = worker_id
        self.applied = applied
        self.got = got


class WrongWorker(RegistryError):
    """The stream at a worker's address comes from another worker (the address was reused).

    Nothing of it is applied; the follower retries, and the worker turns dead if it stays so.
    """

    retryable = True

    def __init__(self, expected: str, got: str) -> None:
        super().__init__(f"expected worker {expected}, but the stream is from worker {got}")
        self.expected = expected
        self.got = got


class BrokenSnapshot(RegistryError):
    """A part of a snapshot came without the parts before it, or something else of the worker
    came between two parts: the follower starts over with a new snapshot."""

    retryable = True

    def __init__(self, worker_id: str, detail: str) -> None:
        super().__init__(f"worker {worker_id}: snapshot in parts broken: {detail}")
        self.worker_id = worker_id


class LogRestarted(RegistryError):
    """The worker's log started over (its data was wiped: another log epoch, or a new boot with
    a lower sequence): its rows are replaced from a fresh snapshot, never merged."""

    retryable = True

    def __init__(self, worker_id: str, why: str) -> None:
        super().__init__(f"worker {worker_id}: its log started over ({why})")
        self.worker_id = worker_id
