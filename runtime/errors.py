"""The one error every service shares: a request field that is malformed.

Each service keeps its own error hierarchy (flaps.errors, ...; the machine API's, which flyd
answers with, is model.errors); their `InvalidArgument` classes derive from this one, so that
the ground floor's validation helpers (`runtime.validate`) can raise it and every service's
boundary answers INVALID_ARGUMENT naming the field, whichever floor found the fault.
"""

from __future__ import annotations


class InvalidArgument(ValueError):
    """A request field is malformed; `field` names it as in the request (`config.guest.cpu`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
