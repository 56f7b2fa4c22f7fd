"""`nonomad tokens` and `nonomad secrets` as a user runs them, against the CLI tests' fleet
(flaps over TLS, checking tokens signed by the session's keys)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import time
from pathlib import Path

import grpc
import pytest

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from flyd.v1 import worker_pb2_grpc
from model.tokens import DEFAULT_TTL, new_key_line
from nonomad.security import CONSOLE_PART
from runtime.pki import part_role, write_private
from tests.cli.conftest import CliFleet, Result, nonomad
from tests.cli.support import one_line_error
from tests.flaps.conftest import eventually
from tests.harness import channel, clean_env

# Prints the SHA-256 of $API_KEY: the log shows the machine has it, never what it is.
HASHER = 'echo "key:$(printf %s "$API_KEY" | sha256sum | cut -c1-64)"; exec sleep 1000'


async def test_tokens_are_minted_narrowed_read_and_enforced(
    cli_fleet: CliFleet, tmp_path: Path
) -> None:
    keys = ["--keys", str(cli_fleet.security.token_keys)]
    reader = (
        await nonomad("tokens", "create", *keys, "--app", "web", "--ops", "read", "--json")
    ).json()
    assert reader["caveats"][:2] == ["apps = web", "ops = read"]
    # Every token expires: 30 days from now unless --expires says.
    expires = int(reader["caveats"][2].removeprefix("expires = "))
    assert abs(expires - (time.time() + DEFAULT_TTL)) < 120, reader["caveats"]
    token = tmp_path / "web.token"
    token.write_text(reader["token"] + "\n")
    as_reader = ["--token-file", str(token), *cli_fleet.tls]

    listed, refused, other_app, narrowed, *usage = await asyncio.gather(
        nonomad("machines", "list", "web", "--json", *as_reader, env=cli_fleet.env),
        nonomad("machines", "run", "web", "--image", "demo:v1", "--region", "ams",
                *as_reader, env=cli_fleet.env),
        nonomad("machines", "list", "api", *as_reader, env=cli_fleet.env),
        nonomad("tokens", "attenuate", "--token-file", str(token), "--expires", "1h",
                "--machine", "m-1"),
        nonomad("tokens", "create", *keys, "--ops", "read"),
        nonomad("tokens", "create", *keys, "--app", "web", "--ops", "fly"),
        nonomad("tokens", "attenuate", "--token-file", str(token)),
        nonomad("tokens", "create", "--keys", str(tmp_path / "none"), "--all-apps"),
    )  # fmt: skip
    assert listed.json() == []
    one_line_error(refused, 1, "PERMISSION_DENIED", 'token caveat "ops = read"', "operation create")
    one_line_error(other_app, 1, "PERMISSION_DENIED", 'token caveat "apps = web"', "app api")
    for result, fragment in zip(
        usage,
        ["--app APP (repeatable) or --all-apps", "unknown operation 'fly'", "nothing to add",
         "no keys file"],
        strict=True,
    ):  # fmt: skip
        one_line_error(result, 2, fragment)

    assert narrowed.code == 0, narrowed.err
    (tmp_path / "narrow.token").write_text(narrowed.out)
    shown = (
        await nonomad("tokens", "show", "--token-file", str(tmp_path / "narrow.token"), "--json")
    ).json()
    assert shown["token_id"] == reader["token_id"]  # the same token, narrowed
    assert shown["caveats"][:3] == reader["caveats"]
    assert shown["caveats"][3].startswith("expires = ")  # sooner: an hour
    assert shown["caveats"][4] == "machines = m-1"

    # Revoked by its id: flaps refuses it once it has read the list again (within a second).
    revoked = await nonomad("tokens", "revoke", *keys, reader["token_id"], "--note", "lost")
    assert revoked.code == 0, revoked.err
    assert revoked.out.startswith(f"token {reader['token_id']} revoked"), revoked.out
    listed_by = cli_fleet.security.revoked_tokens.read_text()
    assert f"{reader['token_id']}  # revoked " in listed_by
    assert listed_by.rstrip().endswith(": lost")

    async def refused() -> bool:
        got = await nonomad("machines", "list", "web", *as_reader, env=cli_fleet.env)
        return got.code == 1 and f"token {reader['token_id']} was revoked" in got.err

    await eventually(refused, 10, "flaps refusing the revoked token")
    again = await nonomad("tokens", "revoke", *keys, reader["token_id"])
    assert again.out.startswith(f"token {reader['token_id']} is already revoked"), again.out
    one_line_error(await nonomad("tokens", "revoke", *keys, "nope"), 2, "not a token id")


async def test_a_key_rotates_without_downtime(cli_fleet: CliFleet, tmp_path: Path) -> None:
    keys = tmp_path / "token-keys"
    write_private(keys, f"{new_key_line('k1')}\n".encode())
    flaps = cli_fleet.fleet.add_flaps("--token-keys", str(keys))  # its own keys, re-read
    kf = ["--keys", str(keys)]

    async def mint() -> Path:
        made = await nonomad("tokens", "create", *kf, "--all-apps", "--ops", "admin")
        assert made.code == 0, made.err
        path = tmp_path / f"{secrets.token_hex(4)}.token"
        path.write_text(made.out)
        return path

    async def works(token: Path) -> bool:
        result = await nonomad(
            "regions", "--flaps", flaps.address, "--token-file", str(token), *cli_fleet.tls
        )
        return result.code == 0

    old = await mint()
    assert await works(old)
    added = await nonomad("tokens", "keygen", *kf)
    assert added.out.startswith("k2 now mints new tokens"), added.err
    new = await mint()
    await eventually(lambda: works(new), 10, "flaps accepting the new key's tokens")
    assert await works(old)  # both, while they rotate
    retired = await nonomad("tokens", "retire", *kf, "k1")
    assert retired.code == 0, retired.err

    async def old_refused() -> bool:
        return not await works(old)

    await eventually(old_refused, 10, "flaps refusing the retired key's tokens")
    assert await works(new)
    one_line_error(await nonomad("tokens", "retire", *kf, "k2"), 2, "the only key")


async def test_secrets_reach_every_machine_of_the_app_and_are_never_shown(
    cli_fleet: CliFleet,
) -> None:
    value = f"s3cret-{secrets.token_hex(8)}"
    digest = hashlib.sha256(value.encode()).hexdigest()
    primary = (
        await cli_fleet(
            "machines", "run", "web", "--image", "demo:v1", "--region", "ams", "--memory", "64",
            "--secret", "OTHER=first", "--json", "--", "sh", "-c", HASHER,
        )
    ).json()  # fmt: skip
    assert primary["config"]["secrets"] == {"OTHER": "<redacted>"}
    standby = (
        await cli_fleet(
            "machines", "run", "web", "--image", "demo:v1", "--region", "ams", "--memory", "64",
            "--standby-for", primary["id"], "--json", "--", "sh", "-c", HASHER,
        )
    ).json()  # fmt: skip
    async with cli_fleet.client() as flaps:
        await eventually(
            lambda: _listed(flaps, {primary["id"], standby["id"]}), 10, "both machines listed"
        )

    put = await cli_fleet("secrets", "set", "web", f"API_KEY={value}", "OTHER=x", "--json")
    outcome = {r["machine_id"]: (r["state"], r["result"]) for r in put.json()}
    assert outcome == {
        primary["id"]: ("started", "updated"),  # restarted with it
        standby["id"]: ("created", "updated"),  # still waiting, now with it
    }
    listed = (await cli_fleet("secrets", "list", "web", "--json")).json()
    assert listed == {name: sorted(outcome) for name in ("API_KEY", "OTHER")}
    show = await cli_fleet("machines", "show", primary["id"])
    assert re.search(r"^secrets\s+API_KEY, OTHER$", show.out, re.M), show.out

    async with cli_fleet.client() as flaps:

        async def hashed() -> bool:
            lines = [line async for line in flaps.machine_logs(primary["id"], tail_lines=50)]
            return f"key:{digest}" in lines

        await eventually(hashed, 15, "the restarted machine logging its key's hash")

    gone = await cli_fleet("secrets", "unset", "web", "OTHER", "NOPE")
    assert gone.code == 0, gone.err
    assert (await cli_fleet("secrets", "list", "web", "--json")).json() == {
        "API_KEY": sorted(outcome)
    }
    # Whatever the CLI printed, the value was never in it.
    for result in (put, show, gone, await cli_fleet("machines", "show", primary["id"], "--json")):
        assert value not in result.out + result.err
    machine = json.loads((await cli_fleet("machines", "show", primary["id"], "--json")).out)
    assert machine["config"]["secrets"] == {"API_KEY": "<redacted>"}
    usage = await nonomad("secrets", "set", "web", "NOEQUALS", env=clean_env())
    one_line_error(usage, 2, "'NOEQUALS' is not KEY=VALUE")


async def _listed(flaps: object, ids: set[str]) -> bool:
    machines = await flaps.list_machines("web")  # type: ignore[attr-defined]
    return {m.id for m in machines} == ids


async def test_only_flaps_certificate_reads_a_workers_secrets(cli_fleet: CliFleet) -> None:
    """RevealSecrets (how flaps copies an app's secrets to a new machine) answers flaps'
    certificate; every other part's, each signed by the same CA, is refused."""
    value = f"s3cret-{secrets.token_hex(8)}"
    cfg = pb.MachineConfig(image="demo:v1", guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64))
    cfg.secrets["API_KEY"] = value
    async with cli_fleet.client() as flaps:
        made = await flaps.create_machine("vault", cfg, region="ams", skip_launch=True)
    security = cli_fleet.security
    address = cli_fleet.fleet.workers[made.worker_id].address
    request = w.RevealSecretsRequest(machine_id=made.id)
    other_worker = next(i for i in cli_fleet.fleet.workers if i != made.worker_id)
    for part in ("cli", CONSOLE_PART, "proxy", f"flyd-{other_worker}", f"flyd-{made.worker_id}"):
        stub = worker_pb2_grpc.WorkerServiceStub(channel(address, security.member_tls(part)))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.RevealSecrets(request, timeout=10)
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED, part
        details = raised.value.details() or ""
        assert f"certificate {part!r} (role {part_role(part)}) may not call" in details, part
        assert "flaps may" in details, details
        assert value not in str(raised.value)
    flaps_cert = worker_pb2_grpc.WorkerServiceStub(channel(address, security.member_tls("flaps")))
    revealed = await flaps_cert.RevealSecrets(request, timeout=10)
    assert dict(revealed.secrets) == {"API_KEY": value}


async def test_workers_cordon_and_uncordon_through_flaps(
    cli_fleet: CliFleet, tmp_path: Path
) -> None:
    def cordoned(result: Result) -> dict[str, bool]:
        assert result.code == 0, result.err
        return {w["info"]["id"]: w["capacity"]["cordoned"] for w in result.json()}

    done = await cli_fleet("workers", "cordon", "ams-1")
    assert done.code == 0, done.err
    assert done.out.startswith("ams-1 cordoned: it takes no new machines"), done.out

    async def seen_cordoned() -> bool:
        return cordoned(await cli_fleet("workers", "--json")) == {"ams-1": True, "ams-2": False}

    await eventually(seen_cordoned, 15, "flaps seeing ams-1 cordoned")
    placed = await cli_fleet(
        "machines", "run", "web", "--image", "demo:v1", "--region", "ams", "--memory", "64",
        "--json", "--", "sleep", "1000",
    )  # fmt: skip
    assert placed.json()["worker_id"] == "ams-2", placed.out

    # Cordoning takes the admin operation cordon: a deploy token may not.
    keys = ["--keys", str(cli_fleet.security.token_keys)]
    deployer = await nonomad("tokens", "create", *keys, "--all-apps", "--ops", "deploy")
    token = tmp_path / "deploy.token"
    token.write_text(deployer.out)
    refused = await nonomad(
        "workers", "uncordon", "ams-1", "--token-file", str(token), *cli_fleet.tls,
        env=cli_fleet.env,
    )  # fmt: skip
    one_line_error(refused, 1, "PERMISSION_DENIED", 'token caveat "ops = deploy"')
    # Nor may an app's token, whatever its ops: the fleet takes an operator token.
    app_admin = await nonomad("tokens", "create", *keys, "--app", "web", "--ops", "*")
    (tmp_path / "app.token").write_text(app_admin.out)
    as_app = ["--token-file", str(tmp_path / "app.token"), *cli_fleet.tls]
    for command in (["workers", "uncordon", "ams-1"], ["workers"], ["regions"]):
        refused = await nonomad(*command, *as_app, env=cli_fleet.env)
        one_line_error(
            refused, 1, "PERMISSION_DENIED", 'token caveat "apps = web"', "operator token"
        )
    assert cordoned(await cli_fleet("workers", "--json"))["ams-1"] is True  # unchanged
    unknown = await cli_fleet("workers", "cordon", "ams-9")
    one_line_error(unknown, 1, "NOT_FOUND", "worker ams-9 not found")

    back = await cli_fleet("workers", "uncordon", "ams-1", "--json")
    assert back.json() == {"worker_id": "ams-1", "cordoned": False}

    async def seen_uncordoned() -> bool:
        return cordoned(await cli_fleet("workers", "--json")) == {"ams-1": False, "ams-2": False}

    await eventually(seen_uncordoned, 15, "flaps seeing ams-1 uncordoned")


async def test_secrets_on_an_app_without_machines_say_what_to_do(cli_fleet: CliFleet) -> None:
    result = await cli_fleet("secrets", "set", "empty", "API_KEY=x")
    one_line_error(
        result, 1, "app empty has no machines", "no store for the app itself",
        "nonomad machines run empty --image IMAGE --secret NAME=VALUE",
    )  # fmt: skip
    assert "API_KEY=x" not in result.out + result.err
