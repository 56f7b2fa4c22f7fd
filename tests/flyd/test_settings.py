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


@pytest.mark.parametrize(
    ("argv", "machine_host"),
    [
        ([], "127.0.0.1"),
        (["--listen", "0.0.0.0:7000"], "127.0.0.1"),
        (["--listen", "10.1.0.2:7000"], "10.1.0.2"),
        # A worker told its address once advertises it for its machines' ports too.
        (["--listen", "0.0.0.0:7000", "--advertise", "10.1.0.3:7000"], "10.1.0.3"),
        (["--advertise", "w1.example:7000", "--machine-host", "10.1.0.4"], "10.1.0.4"),
    ],
)
def test_machine_host_follows_the_advertised_address(argv: list[str], machine_host: str) -> None:
    assert load_settings(FlydSettings, argv, prog="flyd").machine_host == machine_host


@pytest.mark.parametrize(
    ("host", "bound"),
    [("127.0.0.1", "127.0.0.1"), ("127.0.0.2", "127.0.0.2"), ("10.1.0.2", "0.0.0.0")],
)
def test_a_process_machine_s_port_beyond_loopback_is_held_on_every_address(
    host: str, bound: str
) -> None:
    """The process driver's machine is a host process that binds its port itself, most often
    on 0.0.0.0: flyd holds it where the machine will bind it. (The OCI driver binds
    machine_host alone: tests/flyd/test_driver_oci.py.)"""
    from flyd.drivers.ports import bind_address, bind_port

    assert bind_address(host) == bound
    if bound == "0.0.0.0":  # (binding sends nothing anywhere)
        sock = bind_port(bind_address(host), 0)
        assert sock is not None
        with sock:
            assert sock.getsockname()[0] == "0.0.0.0"


def test_route_machines_and_egress_via_are_not_both_the_way_out() -> None:
    import subprocess
    import uuid

    name = f"nonomad-routes-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"an uplink needs a network namespace: {made.stderr.strip()}")
    try:
        argv = ["--route-machines", "--egress-via", f"/run/netns/{name}"]
        with pytest.raises(SettingsError, match="route_machines: not together with egress_via"):
            load_settings(FlydSettings, argv, prog="flyd")
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_what_bounds_a_machine_s_cost_to_flyd_has_defaults() -> None:
    settings = load_settings(FlydSettings, [], prog="flyd")
    assert (settings.log_read_bytes, settings.streams_per_caller) == (1 << 20, 1024)
    assert (settings.log_max_bytes, settings.log_backups) == (1 << 20, 2)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--log-read-bytes", "0"], "log_read_bytes: Input should be greater than 0"),
        (["--streams-per-caller", "0"], "streams_per_caller: Input should be greater than 0"),
        (["--log-backups", "-1"], "log_backups: Input should be greater than or equal to 0"),
        (["--log-max-bytes", "0"], "log_max_bytes: Input should be greater than 0"),
    ],
)
def test_a_bound_that_bounds_nothing_is_refused_naming_it(argv: list[str], says: str) -> None:
    with pytest.raises(SettingsError, match=says):
        load_settings(FlydSettings, argv, prog="flyd")
