"""The app spec: parsing, every validation error (named by file and field), the MachineConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flyd.v1 import machine_pb2 as pb
from model import checks
from nonomad.spec import (
    META_APP,
    META_DIGEST,
    META_REGION,
    META_ROLE,
    META_SLOT,
    SpecError,
    load_spec,
    parse_spec,
)
from tests.deploy.support import spec_data, to_toml

DEMO_TOML = Path(__file__).resolve().parents[2] / "nonomad" / "demo" / "app.toml"


def test_the_demo_spec_matches_what_nonomad_up_deploys() -> None:
    spec = load_spec(DEMO_TOML)
    assert (spec.app, spec.image, spec.regions, spec.standbys) == (
        "demo",
        "demo:v1",
        {"ams": 1, "syd": 1},
        1,
    )
    config = spec.machine_config("ams", "demo-ams-1")
    assert config.guest == pb.GuestConfig(cpu_millicores=250, memory_mib=128)
    assert config.restart.mode == pb.RESTART_MODE_ALWAYS
    [service] = config.services
    assert (service.internal_port, service.autostart, service.autostop) == (8080, True, True)
    assert (service.concurrency.soft_limit, service.concurrency.hard_limit) == (20, 25)
    [check] = config.checks
    assert (check.name, check.http.path, check.port) == ("http", "/", 0)
    assert (check.interval.seconds, check.timeout.seconds) == (1, 2)


def test_machine_config_marks_app_slot_role_and_digest() -> None:
    spec = parse_spec(
        spec_data(
            env={"GREETING": "hi"},
            checks=[{"type": "tcp", "interval": "500ms", "timeout": 1.5}],
            restart={"policy": "on-failure", "max_retries": 3},
        )
    )
    primary = spec.machine_config("ams", "web-ams-1")
    assert dict(primary.metadata) == {
        META_APP: "web",
        META_REGION: "ams",
        META_SLOT: "web-ams-1",
        META_ROLE: "primary",
        META_DIGEST: spec.digest,
    }
    assert list(primary.standbys) == []
    assert primary.env == {"GREETING": "hi"}
    assert primary.restart == pb.RestartPolicy(mode=pb.RESTART_MODE_ON_FAILURE, max_retries=3)
    [check] = primary.checks
    assert check.WhichOneof("kind") == "tcp"
    assert check.name == "tcp-0"
    assert (check.interval.ToMilliseconds(), check.timeout.ToMilliseconds()) == (500, 1500)

    standby = spec.machine_config("ams", "web-ams-1-standby", standby_for="ams-1-abc")
    assert list(standby.standbys) == ["ams-1-abc"]
    assert standby.metadata[META_ROLE] == "standby"
    assert standby.metadata[META_DIGEST] == spec.digest


def test_the_spec_checks_are_what_flyd_runs() -> None:
    """The config carries every field of the spec's checks but the grace period (the deploy's),
    and flyd resolves them to the machine's host ports as the spec meant them."""
    spec = parse_spec(
        spec_data(
            services=[{"internal_port": 8080}, {"internal_port": 9090}],
            checks=[
                {"type": "http", "path": "/up", "interval": "2s", "timeout": "1s"},
                {"name": "admin", "type": "http", "port": 9090, "method": "HEAD", "path": "/"},
                {"name": "tcp", "type": "tcp", "timeout": "500ms", "grace_period": "1m"},
            ],
        )
    )
    machine = pb.Machine(config=spec.machine_config("ams", "web-ams-1"))
    machine.ports.add(internal_port=8080, host_port=30001)
    machine.ports.add(internal_port=9090, host_port=30002)
    resolved = checks.checks_of(machine, "127.0.0.1")
    assert [
        (c.name, c.kind, c.port, c.internal_port, c.method, c.path, c.interval, c.timeout)
        for c in resolved
    ] == [
        ("http-0", "http", 30001, 8080, "GET", "/up", 2.0, 1.0),
        ("admin", "http", 30002, 9090, "HEAD", "/", 1.0, 2.0),
        ("tcp", "tcp", 30001, 8080, "GET", "/", 1.0, 0.5),
    ]


def test_the_digest_follows_the_machine_config_only() -> None:
    base = parse_spec(spec_data())
    assert parse_spec(spec_data()).digest == base.digest
    assert parse_spec(spec_data(env={"A": "1"})).digest != base.digest
    assert parse_spec(spec_data(image="demo:v2")).digest != base.digest
    # Where and how many machines run is not part of a machine's config.
    assert parse_spec(spec_data(regions={"ams": 5, "syd": 1})).digest == base.digest
    assert parse_spec(spec_data(standbys=0)).digest == base.digest


def check(**fields: Any) -> dict[str, Any]:
    return {"checks": [{"type": "http", **fields}]}


def services(*ports: int) -> dict[str, Any]:
    return {"services": [{"internal_port": p} for p in ports]}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"app": "Web"}, "app: app 'Web' must be 1-63 lowercase letters"),
        ({"app": None}, "app: Field required"),  # None: left out
        ({"image": "demo:"}, "image: "),
        ({"image": "demo@sha256:xyz"}, "image: "),
        ({"regions": {}}, "regions: Dictionary should have at least 1 item"),
        ({"regions": {"AMS": 1}}, "regions.AMS (name): region 'AMS' must be"),
        ({"regions": {"ams": -1}}, "regions.ams: Input should be greater than or equal to 0"),
        ({"regions": {"ams": 101}}, "regions.ams: Input should be less than or equal to 100"),
        ({"regions": {"ams": "two"}}, "regions.ams: Input should be a valid integer"),
        ({"standbys": 2}, "standbys: Input should be less than or equal to 1"),
        ({"standbys": -1}, "standbys: Input should be greater than or equal to 0"),
        ({"guest": {"cpu_millicores": 0}}, "guest.cpu_millicores: Input should be greater than 0"),
        ({"guest": {"memory_mib": -5}}, "guest.memory_mib: Input should be greater than 0"),
        ({"guest": {"memory_mb": 5}}, "guest.memory_mb: Extra inputs are not permitted"),
        ({"env": {"1X": "a"}}, "env.1X (name): '1X' is not a variable name"),
        ({"env": {"A": "x" * 5000}}, "env.A: must be under 4096 bytes without NUL"),
        ({"env": {"A": 1}}, "env.A: Input should be a valid string"),
        (
            {"services": [{"internal_port": 65536}]},
            "services[0].internal_port: Input should be less than 65536",
        ),
        ({"services": [{"internal_port": 0}]}, "services[0].internal_port: Input should be"),
        ({"services": [{}]}, "services[0].internal_port: Field required"),
        (
            {"services": [{"internal_port": 80, "min_machines_running": -1}]},
            "services[0].min_machines_running: Input should be greater than or equal to 0",
        ),
        (
            {
                "services": [
                    {"internal_port": 80, "concurrency": {"soft_limit": 9, "hard_limit": 3}}
                ]
            },
            "services[0].concurrency: soft_limit (9) must not exceed hard_limit (3)",
        ),
        (
            {"services": [{"internal_port": 80, "concurrency": {"soft_limit": -1}}]},
            "services[0].concurrency.soft_limit: Input should be greater than or equal to 0",
        ),
        ({**services(80, 80), "checks": []}, "services[1].internal_port: 80 is repeated"),
        (check(type="udp"), "checks[0].type: Input should be 'http' or 'tcp'"),
        (check(path="health"), "checks[0]: path: 'health' must start with /"),
        ({"checks": [{"type": "tcp", "path": "/"}]}, "checks[0]: path: only http checks"),
        (check(port=9090), "checks[0].port: 9090 is not a service port"),
        ({**services(), **check()}, "checks[0].port: is required when there are no services"),
        (check(interval="soon"), "checks[0].interval: 'soon' is not a duration"),
        (check(interval=0), "checks[0].interval: Input should be greater than 0"),
        (check(timeout="2h"), "checks[0].timeout: '2h' is not a duration"),
        (check(timeout=7200), "checks[0].timeout: Input should be less than or equal to 3600"),
        (check(grace_period=-1), "checks[0].grace_period: Input should be greater than or equal"),
        (check(method="POST"), "checks[0].method: Input should be 'GET' or 'HEAD'"),
        (
            {"checks": [{"type": "http", "name": "a"}, {"type": "tcp", "name": "a"}]},
            "checks[1].name: 'a' is repeated",
        ),
        ({"restart": {"policy": "sometimes"}}, "restart.policy: Input should be 'no', 'always'"),
        (
            {"restart": {"policy": "always", "max_retries": 3}},
            "restart: max_retries: only the on-failure policy retries, not 'always'",
        ),
        (
            {"restart": {"max_retries": -1}},
            "restart.max_retries: Input should be greater than or equal to 0",
        ),
        ({"replicas": 3}, "replicas: Extra inputs are not permitted"),
        (
            {"app": "a" * 50, "regions": {"region-with-a-long-name": 1}},
            "app: machine names such as",
        ),
    ],
)
def test_every_bad_field_is_named_with_the_file(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    data = spec_data(**changes)
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "app.toml"
    path.write_text(to_toml(data))
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert f"{path}: {message}" in caught.value.problems[0], caught.value.problems


def test_all_problems_are_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "app.toml"
    path.write_text(
        to_toml(spec_data(standbys=3, guest={"memory_mib": 0}, services=[{"internal_port": 0}]))
    )
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    fields = [p.split(": ")[1] for p in caught.value.problems]
    assert fields == ["standbys", "guest.memory_mib", "services[0].internal_port"]


def test_a_missing_or_malformed_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"nope\.toml: file not found"):
        load_spec(tmp_path / "nope.toml")
    path = tmp_path / "broken.toml"
    path.write_text('app = "web"\nimage = \n')
    with pytest.raises(SpecError, match=r"broken\.toml: not valid TOML: .*line 2"):
        load_spec(path)
