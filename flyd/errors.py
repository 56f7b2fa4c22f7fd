"""flyd's error hierarchy, translated to gRPC status codes in one place (flyd.service)."""

from __future__ import annotations


class FlydError(Exception):
    """Base of every error flyd reports to a caller.

    `retryable` says whether the same call may succeed later without changes.
    """

    retryable = False


class InvalidArgument(FlydError):
    """A request field is malformed; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(FlydError):
    """The machine (or image) does not exist on this worker."""


class AlreadyExists(FlydError):
    """A create collided with a different existing object of the same id."""


class FailedPrecondition(FlydError):
    """The operation is not allowed in the machine's current state."""


class ResourceExhausted(FlydError):
    """The worker has no room; `resource` names what ran out.

    One of cpu, memory, disk, machines, ports.
    """

    retryable = True

    def __init__(self, resource: str, message: str) -> None:
        super().__init__(message)
        self.resource = resource


class Unavailable(FlydError):
    """The worker cannot serve the request right now (shutting down, cordoned)."""

    retryable = True


class DeadlineExceeded(FlydError):
    """A wait ran out of time."""

    retryable = True


class ImageError(FlydError):
    """An image could not be resolved, verified or unpacked."""


class ImageNotFound(ImageError, NotFound):
    """The image source has no image of that name, tag or digest."""


class InvalidImageReference(ImageError, InvalidArgument):
    """An image reference does not parse."""

    def __init__(self, message: str) -> None:
        InvalidArgument.__init__(self, "config.image", message)


class UnsafeImage(ImageError):
    """An image archive tried to escape its target or holds forbidden entries."""


class CorruptLog(FlydError):
    """The machine log holds what this flyd cannot interpret: unknown type, gap, newer version.

    Never guessed around: flyd refuses to start on it.
    """
