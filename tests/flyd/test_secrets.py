"""Machine secrets on a worker: they reach the machine's environment and nowhere else.

A Worker on a FakeDriver over a real LMDB log: what the worker hands out (the machine, its
events, its stream) has each secret's name only; the log holds the values sealed with the
worker's key; the process is spawned with the values; updates keep, replace and drop them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flyd.secrets import REDACTED, SecretBox
from flyd.v1 import machine_pb2 as pb
from model.errors import AlreadyExists, InvalidArgument, NotFound
from model.validate import check_config
from tests.flyd.support import (
    STARTED,
    Flyd,
    Node,
    config,
    log_changes,
    settled,
    until,
)

SECRET = "s3cret-" + os.urandom(8).hex()  # a value nothing else could contain by chance


def with_secrets(**secrets: str) -> pb.MachineConfig:
    made = config()
    made.secrets.update(secrets)
    return made


@pytest.fixture
def box() -> SecretBox:
    return SecretBox.ephemeral()


@pytest.fixture
def flyd(node: Node, box: SecretBox) -> Flyd:
    return node.boot(secret_box=box)


def spawned_env(f: Flyd) -> dict[str, str]:
    return f.driver.starts[-1].env


def everything_handed_out(f: Flyd, machine_id: str) -> bytes:
    """What the worker shows anyone: the machine, its events, every record of its stream."""
    out = f.worker.get(machine_id).machine.SerializeToString()
    out += b"".join(e.SerializeToString() for e in f.worker.events(machine_id))
    out += b"".join(c.SerializeToString() for c in log_changes(f.store))
    return out


async def test_a_secret_reaches_the_environment_and_is_redacted_everywhere_else(
    flyd: Flyd, tmp_path: Path
) -> None:
    machine = await flyd.worker.create(
        machine_id="m1", name="", app="web", config=with_secrets(TOKEN=SECRET), skip_launch=False
    )
    assert dict(machine.config.secrets) == {"TOKEN": REDACTED}
    assert spawned_env(flyd)["TOKEN"] == SECRET
    assert SECRET.encode() not in everything_handed_out(flyd, "m1")
    # At rest, in the LMDB files, it is sealed.
    await flyd.worker.flush()
    for path in (tmp_path / "log").iterdir():
        assert SECRET.encode() not in path.read_bytes(), path


async def test_updates_keep_replace_and_drop_secrets(flyd: Flyd) -> None:
    w = flyd.worker
    await w.create(
        machine_id="m1",
        name="",
        app="web",
        config=with_secrets(A="one", B="two"),
        skip_launch=False,
    )
    # As read back (A and B redacted), with C added: A and B keep their values.
    read = pb.MachineConfig()
    read.CopyFrom(w.get("m1").machine.config)
    read.secrets["C"] = "three"
    await w.update("m1", read, skip_launch=False)
    await until(w, settled(w, "m1", STARTED))
    assert {k: spawned_env(flyd)[k] for k in "ABC"} == {"A": "one", "B": "two", "C": "three"}
    # A new value replaces; a name left out is gone.
    changed = with_secrets(A="uno", C=REDACTED)
    await w.update("m1", changed, skip_launch=False)
    await until(w, settled(w, "m1", STARTED))
    env = spawned_env(flyd)
    assert (env["A"], env["C"], "B" in env) == ("uno", "three", False)
    assert dict(w.get("m1").machine.config.secrets) == {"A": REDACTED, "C": REDACTED}
    # Keeping a secret the machine does not have is an error naming it, and changes nothing.
    with pytest.raises(InvalidArgument, match=r"config.secrets\[D\]"):
        await w.update("m1", with_secrets(D=REDACTED), skip_launch=False)
    assert set(w.get("m1").machine.config.secrets) == {"A", "C"}


async def test_a_retried_create_matches_its_secrets_in_constant_time(flyd: Flyd) -> None:
    w = flyd.worker
    first = await w.create(
        machine_id="m1", name="", app="web", config=with_secrets(K=SECRET), skip_launch=False
    )
    again = await w.create(
        machine_id="m1", name="", app="web", config=with_secrets(K=SECRET), skip_launch=False
    )
    assert again.instance_id == first.instance_id
    with pytest.raises(AlreadyExists) as raised:
        await w.create(
            machine_id="m1", name="", app="web", config=with_secrets(K="other"), skip_launch=False
        )
    assert SECRET not in str(raised.value)


async def test_a_restarted_worker_opens_its_secrets_with_its_key(
    node: Node, box: SecretBox
) -> None:
    f = node.boot(secret_box=box)
    await f.worker.create(
        machine_id="m1", name="", app="web", config=with_secrets(K=SECRET), skip_launch=True
    )
    await f.kill()
    f = node.boot(secret_box=box)
    await f.worker.start("m1")
    assert spawned_env(f)["K"] == SECRET
    await f.worker.stop("m1", None, None)
    await until(f.worker, settled(f.worker, "m1", pb.MACHINE_STATE_STOPPED))
    await f.kill()
    # Another key opens nothing: the start fails, saying which secret, never its value.
    f = node.boot(secret_box=SecretBox.ephemeral())
    await f.worker.start("m1")
    await until(f.worker, lambda: f.worker.get("m1").state == pb.MACHINE_STATE_FAILED)
    reasons = " ".join(e.reason for e in f.worker.events("m1"))
    assert "secret K of machine m1 does not open" in reasons
    assert SECRET not in reasons


def test_the_key_file_is_made_once_and_private(tmp_path: Path) -> None:
    path = tmp_path / "secrets.key"
    sealed = SecretBox.load(path).seal("m1", "K", SECRET)
    assert path.stat().st_mode & 0o777 == 0o600
    assert SecretBox.load(path).open("m1", "K", sealed) == SECRET
    # Bound to the machine and the name.
    with pytest.raises(Exception, match="does not open"):
        SecretBox.load(path).open("m2", "K", sealed)


@pytest.mark.parametrize(
    ("secrets", "env", "field"),
    [
        ({"1BAD": "x"}, {}, "config.secrets"),
        ({"K": "x\x00y"}, {}, "config.secrets[K]"),
        ({"K": "x" * 5000}, {}, "config.secrets[K]"),
        ({"K": "x"}, {"K": "y"}, "config.secrets[K]"),
    ],
)
def test_bad_secrets_are_named_and_never_quoted(
    secrets: dict[str, str], env: dict[str, str], field: str
) -> None:
    bad = with_secrets(**secrets)
    bad.env.update(env)
    with pytest.raises(InvalidArgument) as raised:
        check_config(bad)
    assert raised.value.field == field
    for value in secrets.values():
        assert value not in str(raised.value)


async def test_revealed_only_for_a_living_machine(flyd: Flyd) -> None:
    """What flaps copies to a new machine of the app: the values, while the machine lives."""
    w = flyd.worker
    await w.create(
        machine_id="m1", name="", app="web", config=with_secrets(K=SECRET), skip_launch=False
    )
    assert w.reveal_secrets("m1") == {"K": SECRET}
    with pytest.raises(NotFound):
        w.reveal_secrets("m2")
    with pytest.raises(InvalidArgument, match="machine_id"):
        w.reveal_secrets("")
    await w.destroy("m1", force=True)
    await until(w, lambda: w.get("m1").machine.state == pb.MACHINE_STATE_DESTROYED)
    assert w.reveal_secrets("m1") == {}
