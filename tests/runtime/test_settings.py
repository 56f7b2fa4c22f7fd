"""Loading ServiceSettings: precedence, validation messages, the config file, nesting."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, Field
from pydantic_settings import SettingsConfigDict

from runtime import (
    ServiceSettings,
    SettingsError,
    load_settings,
    parse_host_port,
    settings_or_exit,
)


class Capacity(BaseModel):
    """A nested model, as flyd has."""

    memory_mib: int = Field(default=1024, gt=0)
    cpus: int = 2


class ExampleSettings(ServiceSettings):
    """A service's settings: the common ones plus its own."""

    model_config = SettingsConfigDict(env_prefix="NNTEST_")

    region: str = "ams"
    capacity: Capacity = Capacity()


def load(argv: list[str]) -> ExampleSettings:
    return load_settings(ExampleSettings, argv, prog="flyd")


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    return tmp_path / "flyd.toml"


def test_defaults() -> None:
    settings = load([])
    assert settings.listen == "127.0.0.1:0"
    assert settings.grace_period == 5.0
    assert settings.log_level == "info"
    assert settings.ready_file is None
    assert settings.tls_cert is None
    assert settings.capacity == Capacity()


@pytest.mark.parametrize(
    ("in_toml", "in_env", "in_flags", "expected"),
    [
        (None, None, None, 5.0),
        ("4", None, None, 4.0),
        ("4", "3", None, 3.0),
        ("4", "3", "2", 2.0),
        (None, "3", "2", 2.0),
        ("4", None, "2", 2.0),
    ],
)
def test_precedence_flags_over_env_over_toml_over_defaults(
    monkeypatch: pytest.MonkeyPatch,
    config_file: Path,
    in_toml: str | None,
    in_env: str | None,
    in_flags: str | None,
    expected: float,
) -> None:
    config_file.write_text(f"grace_period = {in_toml}\n" if in_toml else "")
    argv = ["--config", str(config_file)]
    if in_env:
        monkeypatch.setenv("NNTEST_GRACE_PERIOD", in_env)
    if in_flags:
        argv += ["--grace-period", in_flags]
    assert load(argv).grace_period == expected


def test_each_setting_comes_from_its_own_source(
    monkeypatch: pytest.MonkeyPatch, config_file: Path
) -> None:
    config_file.write_text('listen = "127.0.0.1:7001"\nregion = "syd"\n[capacity]\ncpus = 8\n')
    monkeypatch.setenv("NNTEST_CONFIG", str(config_file))
    monkeypatch.setenv("NNTEST_LOG_LEVEL", "debug")
    settings = load(["--capacity.memory-mib", "512"])
    assert settings.listen == "127.0.0.1:7001"
    assert settings.region == "syd"
    assert settings.log_level == "debug"
    # Nested values from two sources merge field by field.
    assert settings.capacity == Capacity(memory_mib=512, cpus=8)


def test_config_flag_beats_config_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "env.toml").write_text('region = "from-env-file"\n')
    (tmp_path / "flag.toml").write_text('region = "from-flag-file"\n')
    monkeypatch.setenv("NNTEST_CONFIG", str(tmp_path / "env.toml"))
    assert load([f"--config={tmp_path / 'flag.toml'}"]).region == "from-flag-file"


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({"NNTEST_CAPACITY__MEMORY_MIB": "2048"}, [], Capacity(memory_mib=2048)),
        ({}, ["--capacity.memory-mib", "256"], Capacity(memory_mib=256)),
        (
            {"NNTEST_CAPACITY__CPUS": "16"},
            ["--capacity.memory-mib=256"],
            Capacity(memory_mib=256, cpus=16),
        ),
        (
            {"NNTEST_CAPACITY__MEMORY_MIB": "2048"},
            ["--capacity.memory-mib", "256"],
            Capacity(memory_mib=256),
        ),
    ],
)
def test_nested_setting_from_env_and_flags(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str], expected: Capacity
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert load(argv).capacity == expected


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--grace-period", "0"],
            {},
            "invalid setting grace_period: Input should be greater than 0",
        ),
        (
            [],
            {"NNTEST_GRACE_PERIOD": "-1"},
            "invalid setting grace_period: Input should be greater",
        ),
        (
            ["--grace-period", "soon"],
            {},
            "invalid setting grace_period: Input should be a valid number",
        ),
        (["--listen", "localhost"], {}, "invalid setting listen: expected host:port"),
        (["--listen", "127.0.0.1:65536"], {}, "invalid setting listen: port must be in 0..65535"),
        (["--listen", "127.0.0.1:http"], {}, "invalid setting listen: port must be a number"),
        (["--listen", "::1:80"], {}, "invalid setting listen: IPv6 addresses need brackets"),
        (["--log-level", "loud"], {}, "invalid setting log_level: Input should be 'debug'"),
        (
            ["--max-message-bytes", "0"],
            {},
            "invalid setting max_message_bytes: Input should be greater",
        ),
        (["--tls-cert", "{file}"], {}, "invalid setting tls_key: required when tls_cert is set"),
        (["--tls-key", "{file}"], {}, "invalid setting tls_key: set without tls_cert"),
        (
            ["--tls-cert", "{missing}", "--tls-key", "{file}"],
            {},
            "invalid setting tls_cert: file not found",
        ),
        (
            ["--tls-cert", "{file}", "--tls-key", "{missing}"],
            {},
            "invalid setting tls_key: file not found",
        ),
        (
            ["--tls-client-ca", "{file}"],
            {},
            "invalid setting tls_client_ca: mutual TLS needs a server",
        ),
        (
            ["--tls-cert", "{file}", "--tls-key", "{file}", "--tls-client-ca", "{missing}"],
            {},
            "invalid setting tls_client_ca: file not found",
        ),
        (
            ["--capacity.memory-mib", "lots"],
            {},
            "invalid setting capacity.memory_mib: Input should be",
        ),
        (
            [],
            {"NNTEST_CAPACITY__MEMORY_MIB": "0"},
            "invalid setting capacity.memory_mib: Input should",
        ),
        (["--bogus", "1"], {}, "unrecognized arguments: --bogus"),
    ],
)
def test_invalid_setting_is_named(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    argv: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    existing = tmp_path / "exists.pem"
    existing.write_text("not really a certificate")
    paths = {"{file}": str(existing), "{missing}": str(tmp_path / "missing.pem")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as raised:
        load([paths.get(arg, arg) for arg in argv])
    assert str(raised.value).startswith("flyd: ")
    assert message in str(raised.value)


def test_every_bad_setting_is_reported_on_its_own_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNTEST_LOG_LEVEL", "loud")
    with pytest.raises(SettingsError) as raised:
        load(["--grace-period", "0", "--listen", "nowhere"])
    lines = str(raised.value).splitlines()
    assert [line.split(":")[1] for line in lines] == [
        " invalid setting listen",
        " invalid setting grace_period",
        " invalid setting log_level",
    ]


def test_unknown_key_in_toml_is_named(config_file: Path) -> None:
    config_file.write_text("grace_periode = 3\n")
    with pytest.raises(SettingsError, match="invalid setting grace_periode: Extra inputs"):
        load(["--config", str(config_file)])


@pytest.mark.parametrize("via", ["flag", "env"])
def test_missing_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, via: str) -> None:
    missing = tmp_path / "nope.toml"
    argv = ["--config", str(missing)] if via == "flag" else []
    if via == "env":
        monkeypatch.setenv("NNTEST_CONFIG", str(missing))
    with pytest.raises(
        SettingsError, match=r"flyd: invalid setting config: file not found: .*nope"
    ):
        load(argv)


def test_malformed_config_file(config_file: Path) -> None:
    config_file.write_text("grace_period = = 3\n")
    with pytest.raises(SettingsError, match=r"flyd: invalid setting config: .*flyd\.toml"):
        load(["--config", str(config_file)])


def test_help_lists_kebab_case_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        load(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--listen", "--grace-period", "--ready-file", "--capacity.memory-mib"):
        assert flag in out


def test_settings_or_exit_prints_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        settings_or_exit(ExampleSettings, ["--grace-period", "0"], "flyd")
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "flyd: invalid setting grace_period: Input should be greater than 0\n"
    )


def test_plain_construction_reads_environment_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNTEST_REGION", "fra")
    settings = ExampleSettings(grace_period=1.5)
    assert (settings.region, settings.grace_period) == ("fra", 1.5)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("localhost:50051", ("localhost", 50051)),
        ("0.0.0.0:65535", ("0.0.0.0", 65535)),
        ("[::1]:8080", ("::1", 8080)),
    ],
)
def test_parse_host_port(value: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(value) == expected


@pytest.mark.parametrize("value", ["", ":80", "host", "host:", "host:-1", "[]:80", "::1:80"])
def test_parse_host_port_rejects(value: str) -> None:
    with pytest.raises(ValueError, match=r"host:port|port|brackets"):
        parse_host_port(value)
