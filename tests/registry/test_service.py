"""RegistryService's error mapping, the standalone settings and what serve_replica takes of
them (its RPCs: test_servicer.py)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from registry.errors import InvalidArgument, RegistryError, SequenceGap, Unavailable
from registry.service import RegistryServicer, map_error, serve_replica
from registry.settings import FOLLOWS_PER_CALLER, RegistrySettings
from registry.v1 import registry_pb2 as r
from registry.v1 import registry_pb2_grpc
from runtime import Service, SettingsError, load_settings


def test_every_rpc_of_the_proto_is_implemented() -> None:
    service = r.DESCRIPTOR.services_by_name["RegistryService"]
    base = registry_pb2_grpc.RegistryServiceServicer
    missing = [
        method.name
        for method in service.methods
        if getattr(RegistryServicer, method.name) is getattr(base, method.name)
    ]
    assert not missing


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument("worker.id", "is required"), grpc.StatusCode.INVALID_ARGUMENT),
        (Unavailable("stopping"), grpc.StatusCode.UNAVAILABLE),
        (SequenceGap("w1", 3, 5), grpc.StatusCode.UNAVAILABLE),
        (RegistryError("other"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_registry_errors_map_to_one_status_each(error: Exception, code: grpc.StatusCode) -> None:
    assert map_error(error) == (code, str(error))


def test_foreign_errors_are_not_mapped() -> None:
    assert map_error(KeyError("x")) is None


# -- standalone settings ---------------------------------------------------------------------


def test_settings_defaults_and_flags() -> None:
    settings = load_settings(
        RegistrySettings,
        ["--workers", "127.0.0.1:1,127.0.0.1:2", "--peers", "10.0.0.1:7000", "--dead-after", "3"],
        prog="registry",
    )
    assert settings.workers == ["127.0.0.1:1", "127.0.0.1:2"]
    assert settings.peers == ["10.0.0.1:7000"]
    assert settings.upstream is None
    assert (settings.suspect_after, settings.dead_after) == (0.6, 3.0)
    assert settings.follows_per_caller == FOLLOWS_PER_CALLER


class Recording(Service):
    """A Service that keeps what is added to it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.servicers: list[object] = []

    def add(self, servicer: Any, *args: Any, **kwargs: Any) -> None:
        self.servicers.append(servicer)
        super().add(servicer, *args, **kwargs)


@pytest.mark.parametrize(
    ("argv", "cap"), [([], FOLLOWS_PER_CALLER), (["--follows-per-caller", "3"], 3)]
)
async def test_the_served_replica_caps_follow_streams_as_its_settings_say(
    argv: list[str], cap: int
) -> None:
    settings = load_settings(RegistrySettings, argv, prog="registry")
    service = Recording("registry", settings)
    serve_replica(service, settings.replica(), [])
    [servicer] = service.servicers
    assert isinstance(servicer, RegistryServicer)
    assert servicer.follows.limit == cap


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--workers", "nohost"], "workers"),
        (["--peers", "a:b"], "peers"),
        (["--upstream", "x"], "upstream"),
        (["--suspect-after", "0"], "suspect_after"),
        (["--retry-max", "0"], "retry_max"),
        (["--follows-per-caller", "0"], "follows_per_caller"),
    ],
)
def test_bad_settings_name_the_setting(argv: list[str], named: str) -> None:
    with pytest.raises(SettingsError, match=f"registry: invalid setting {named}"):
        load_settings(RegistrySettings, argv, prog="registry")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # Only dead_after given: it is named as passed, forget_after as a default, and the fix.
        (
            ["--dead-after", "600"],
            "dead_after must be less than forget_after: --dead-after 600 is not below "
            "forget_after 600s (its default); pass a dead_after below 600, or raise forget_after "
            "with --forget-after",
        ),
        # Only the higher one given: it is the one to change.
        (
            ["--dead-after", "0.5"],
            "suspect_after must be less than dead_after: suspect_after 0.6s (its default) is not "
            "below --dead-after 0.5; pass a dead_after above 0.6, or lower suspect_after with "
            "--suspect-after",
        ),
        (
            ["--suspect-after", "2", "--dead-after", "1"],
            "suspect_after must be less than dead_after: --suspect-after 2 is not below "
            "--dead-after 1",
        ),
    ],
)
def test_timeouts_out_of_order_name_what_was_passed(argv: list[str], says: str) -> None:
    """A check across settings names the ones the user passed, not one they never touched."""
    with pytest.raises(SettingsError) as raised:
        load_settings(RegistrySettings, argv, prog="registry")
    assert str(raised.value).startswith(f"registry: {says}")
