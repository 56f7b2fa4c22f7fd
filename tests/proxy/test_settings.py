"""The proxy's settings: the data plane's limits and the event loop are settable and checked."""

from __future__ import annotations

from ipaddress import ip_network

import pytest

from proxy.limits import Limits
from proxy.settings import ProxySettings
from runtime import SettingsError, load_settings


def test_the_default_limits_are_the_data_planes_defaults() -> None:
    assert load_settings(ProxySettings, [], prog="proxy").limits() == Limits()


def test_limits_come_from_flags_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROXY_UPSTREAM_RESPONSE_TIMEOUT", "5")
    settings = load_settings(
        ProxySettings,
        ["--max-body-bytes", "1000", "--pool-size-per-backend", "0", "--event-loop", "asyncio"],
        prog="proxy",
    )
    limits = settings.limits()
    assert limits.max_connections_per_machine == Limits().max_connections_per_machine
    assert limits.max_body_bytes == 1000
    assert limits.pool_size_per_backend == 0
    assert limits.upstream_response_timeout == 5.0
    assert limits.header_timeout == Limits().header_timeout
    assert settings.event_loop == "asyncio"


@pytest.mark.parametrize(
    ("flag", "value", "setting"),
    [
        ("--max-body-bytes", "-1", "max_body_bytes"),
        ("--max-header-bytes", "10", "max_header_bytes"),
        ("--header-timeout", "0", "header_timeout"),
        ("--upstream-response-timeout", "-2", "upstream_response_timeout"),
        ("--max-connections", "0", "max_connections"),
        ("--max-retries", "-1", "max_retries"),
        ("--buffer-bytes", "many", "buffer_bytes"),
        ("--max-connections-per-machine", "0", "max_connections_per_machine"),
        ("--trusted-proxies", "10.0.0.1/8", "trusted_proxies"),  # host bits set
        ("--trusted-proxies", "10.0.0.0/8,proxy.example", "trusted_proxies"),
        ("--event-loop", "trio", "event_loop"),
    ],
)
def test_a_bad_limit_is_refused_naming_the_setting(flag: str, value: str, setting: str) -> None:
    with pytest.raises(SettingsError, match=f"invalid setting {setting}:"):
        load_settings(ProxySettings, [flag, value], prog="proxy")


@pytest.mark.parametrize(
    ("field", "value"),
    [("read_timeout", 0.0), ("max_body_bytes", -1), ("max_connections", 0)],
)
def test_limits_built_in_code_are_checked_too(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        Limits(**{field: value})  # type: ignore[arg-type]


def test_trusted_proxies_are_networks_and_none_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(ProxySettings, [], prog="proxy").trusted_networks() == ()
    settings = load_settings(
        ProxySettings, ["--trusted-proxies", "10.0.0.0/8,192.0.2.7,2001:db8::/32"], prog="proxy"
    )
    assert settings.trusted_networks() == (
        ip_network("10.0.0.0/8"),
        ip_network("192.0.2.7/32"),
        ip_network("2001:db8::/32"),
    )
    monkeypatch.setenv("PROXY_TRUSTED_PROXIES", '["172.16.0.0/12"]')
    from_env = load_settings(ProxySettings, [], prog="proxy")
    assert from_env.trusted_networks() == (ip_network("172.16.0.0/12"),)
