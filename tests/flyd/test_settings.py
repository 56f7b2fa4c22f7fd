"""flyd's settings that choose and shape its driver: checked at start, each bad one named."""

from __future__ import annotations

import pytest

from flyd.settings import FlydSettings
from runtime import SettingsError, load_settings


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--driver", "docker"], "driver"),
        (["--network", "8.8.8.0/24"], "private"),
        (["--network", "10.0.0.0/31"], "at least 4"),
        (["--network", "not-a-prefix"], "network"),
        (["--uid-base", "1000"], "multiple of 65536"),
        # Its machines are named `<worker id>-<12 hex>`, and an id is at most 63 characters.
        (["--worker-id", "w" * 51], "at most 50 characters"),
    ],
)
def test_driver_settings_are_checked_at_start(argv: list[str], says: str) -> None:
    with pytest.raises(SettingsError, match=says):
        load_settings(FlydSettings, argv, prog="flyd")
