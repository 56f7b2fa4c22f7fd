"""Who may pin a request to one machine (`nonomad-force-instance-id`): whoever sends, in
`nonomad-token`, a token (flaps.tokens) that may read the app and that machine.

The proxy verifies it with the same root keys as flaps (`--token-keys`); without them it
refuses every pin rather than honour one from anybody.
"""

from __future__ import annotations

from collections.abc import Callable

from flaps.tokens import Denied, InvalidToken, Keyring

__all__ = ["PinCheck", "pin_check"]

PinCheck = Callable[[str, str, bytes | None], str | None]
"""(app, machine id, the nonomad-token header or None) -> None if allowed, else why not."""


def pin_check(keys: Callable[[], Keyring] | None) -> PinCheck:
    """The check of a pinned request; `keys()` gives the root keys (None: there are none)."""

    def check(app: str, machine_id: str, token: bytes | None) -> str | None:
        if keys is None:
            return "this proxy has no token keys: it pins no requests"
        if token is None:
            return (
                f"pinning a machine needs a nonomad-token header with a token that may read "
                f"app {app}"
            )
        try:
            grant = keys().verify(token.decode("latin-1"))
            grant.check(("read",), app, machine_id)
        except (InvalidToken, Denied) as err:
            return f"nonomad-token: {err}"
        return None

    return check
