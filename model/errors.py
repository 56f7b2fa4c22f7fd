"""The machine API's errors: what flyd answers a call with, and what the rules of this floor
raise (a config that does not validate, an image reference that does not parse, a claim
that lost). flyd translates them to gRPC status codes in one place (flyd.service); flaps and
the CLI catch them where they apply the same rules."""

from __future__ import annotations

from runtime import errors as runtime_errors

DOMAIN = "flyd.nonomad"
"""`google.rpc.ErrorInfo.domain` of the reasons flyd gives."""

# FailedPrecondition's reasons (see there).
BUSY = "MACHINE_BUSY"
LEASED = "LEASE_HELD"
DESTROYED = "MACHINE_DESTROYED"
REPLACED = "INSTANCE_REPLACED"
WRONG_STATE = "WRONG_STATE"
STANDBY = "STANDBY"
SUPERSEDED = "SUPERSEDED"
# Unavailable's reason: the worker itself refused, so nothing was done (a caller tells it
# apart from a broken connection, after which the call may have been carried out).
REFUSED_NOW = "WORKER_UNAVAILABLE"


class FlydError(Exception):
    """Base of every error flyd reports to a caller.

    `retryable` says whether the same call may succeed later without changes. `reason`, when
    set, is sent as a `google.rpc.ErrorInfo` (domain `flyd.nonomad`) with the status, for
    callers to act on without reading the message.
    """

    retryable = False
    reason = ""

    @property
    def metadata(self) -> dict[str, str]:
        """What the ErrorInfo carries besides the reason."""
        return {}


class InvalidArgument(FlydError, runtime_errors.InvalidArgument):
    """A request field is malformed; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        runtime_errors.InvalidArgument.__init__(self, field, message)


class NotFound(FlydError):
    """The machine (or image) does not exist on this worker."""


class AlreadyExists(FlydError):
    """A create collided with a different existing object of the same id."""


class FailedPrecondition(FlydError):
    """The operation is not allowed in the machine's current state; `reason` says why:

    - MACHINE_BUSY: an operation (start, stop, update, ...) is under way; retry when it settles.
    - LEASE_HELD: someone else holds the machine's lease; pass its nonce, or wait it out.
    - MACHINE_DESTROYED: the machine is destroyed or being destroyed; it never comes back.
    - INSTANCE_REPLACED: the machine was updated to another instance than the one waited for.
    - WRONG_STATE: the operation needs another state (a signal needs a started machine).
    - STANDBY: the machine stands by for another member of its slot; only a promotion (a start
      naming a generation) starts it.
    - SUPERSEDED: the promotion names a generation its slot already holds for another member.
    """

    def __init__(self, message: str, reason: str = WRONG_STATE) -> None:
        super().__init__(message)
        self.reason = reason


class ResourceExhausted(FlydError):
    """The worker has no room; `resource` names what ran out.

    One of cpu, memory, disk, machines, ports.
    """

    retryable = True
    reason = "NO_ROOM"

    def __init__(self, resource: str, message: str) -> None:
        super().__init__(message)
        self.resource = resource

    @property
    def metadata(self) -> dict[str, str]:
        return {"resource": self.resource}


class Unavailable(FlydError):
    """The worker cannot serve the request right now (shutting down, cordoned); it did
    nothing (reason WORKER_UNAVAILABLE)."""

    retryable = True
    reason = REFUSED_NOW


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


class ImageDenied(FlydError):
    """The machine's app may not run the image its config names (model.images.owners): not
    the app's own, not shared with it, not public. Sent as PERMISSION_DENIED with the reason
    IMAGE_DENIED, naming the field, the image and its owner."""

    reason = "IMAGE_DENIED"
    field = "config.image"

    def __init__(self, image: str, owner: str, message: str) -> None:
        super().__init__(f"{self.field}: {message}")
        self.image = image
        self.owner = owner

    @property
    def metadata(self) -> dict[str, str]:
        return {"field": self.field, "image": self.image, "owner": self.owner}


class CorruptLog(FlydError):
    """The machine log holds what this flyd cannot interpret: unknown type, gap, newer version.

    Never guessed around: flyd refuses to start on it.
    """
