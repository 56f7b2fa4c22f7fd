"""flaps' errors and the one function that turns them into gRPC statuses."""

from __future__ import annotations

from collections import Counter

import grpc
from google.rpc.error_details_pb2 import ErrorInfo

from runtime import Mapped, error_info
from runtime import errors as runtime_errors

DOMAIN = "flaps.nonomad"
"""`google.rpc.ErrorInfo.domain` of the reasons flaps gives."""


class FlapsError(Exception):
    """Base of every error flaps reports; `info`, when set, is sent with its status."""

    code = grpc.StatusCode.INTERNAL
    retryable = False
    info: ErrorInfo | None = None


class InvalidArgument(FlapsError, runtime_errors.InvalidArgument):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        runtime_errors.InvalidArgument.__init__(self, field, message)


class NotFound(FlapsError):
    code = grpc.StatusCode.NOT_FOUND


class DeadlineExceeded(FlapsError):
    """The caller's deadline passed before the answer was ready; nothing was left behind."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(FlapsError):
    """A worker that owns the machine cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class KeyInDoubt(Unavailable):
    """A create under an idempotency key cannot go on yet: a worker of its regions may hold
    the key's machine, or is making it, and the view cannot tell (reason KEY_IN_DOUBT, with
    the worker and the machine id). Nothing was made: retry."""

    def __init__(self, worker_id: str, machine_id: str, message: str) -> None:
        super().__init__(message)
        self.info = ErrorInfo(
            reason="KEY_IN_DOUBT",
            domain=DOMAIN,
            metadata={"worker": worker_id, "machine_id": machine_id},
        )


class NoCapacity(FlapsError):
    """Nothing in the named regions can take the machine: immediate-or-cancel."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True

    def __init__(self, regions: list[str], counts: Counter[str]) -> None:
        by_reason = ", ".join(f"{n} {reason}" for reason, n in counts.most_common()) or "no workers"
        super().__init__(f"no worker in {', '.join(regions)} can take the machine ({by_reason})")
        self.regions = regions
        self.counts = counts


class ImageDenied(FlapsError):
    """The machine's app may not run the image its config names (model.images.owners), as
    flaps' view of the image source says: refused before any worker is claimed on, as the
    worker would refuse it (reason IMAGE_DENIED, naming the field, the image and its owner)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    field = "config.image"

    def __init__(self, image: str, owner: str, message: str) -> None:
        super().__init__(f"{self.field}: {message}")
        self.info = ErrorInfo(
            reason="IMAGE_DENIED",
            domain=DOMAIN,
            metadata={"field": self.field, "image": image, "owner": owner},
        )


class Upstream(FlapsError):
    """A worker's own answer, passed on as it is (its status is final), with the ErrorInfo
    that names its reason, if it sent one."""

    def __init__(self, err: grpc.aio.AioRpcError) -> None:
        super().__init__(err.details() or str(err.code()))
        self.code = err.code()
        self.info: ErrorInfo | None = error_info(err)


def map_error(err: Exception) -> Mapped | None:
    """flaps' errors (and flyd's validation errors it reuses) as gRPC statuses."""
    if isinstance(err, FlapsError) and err.info is not None:
        return err.code, str(err), err.info
    if isinstance(err, FlapsError):
        return err.code, str(err)
    if isinstance(err, runtime_errors.InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    return None
