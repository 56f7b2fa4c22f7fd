"""The `nonomad` CLI run as a user runs it: subprocesses against a real fleet of 2 flyd + flaps."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nonomad.client import Client
from nonomad.security import ClusterSecurity
from tests.flaps.conftest import Fleet, eventually, fleet
from tests.harness import REPO_ROOT, clean_env

__all__ = ["CliFleet", "Result", "cli_fleet", "fleet", "nonomad"]

NONOMAD = [sys.executable, "-m", "nonomad.cli"]


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        assert self.code == 0, self.err
        return json.loads(self.out)


async def nonomad(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> Result:
    """Run `python -m nonomad.cli ARGS` to its end and collect what it printed."""
    proc = await asyncio.create_subprocess_exec(
        *NONOMAD,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT,
        env=env if env is not None else clean_env(),
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


@dataclass
class CliFleet:
    """Two workers in ams and a flaps that serves TLS and checks tokens, named to the CLI by
    $NONOMAD_FLAPS; the CLI gets the cluster's CA and the admin token."""

    fleet: Fleet
    security: ClusterSecurity

    @property
    def address(self) -> str:
        return self.fleet.flaps[0].address

    @property
    def token_file(self) -> Path:
        return self.security.admin_token

    @property
    def tls(self) -> list[str]:
        """The flag that makes the CLI check flaps' certificate."""
        return ["--tls-ca", str(self.security.ca)]

    @property
    def env(self) -> dict[str, str]:
        return clean_env(NONOMAD_FLAPS=self.address)

    def client(self) -> Client:
        return self.fleet.client(timeout=20)

    async def __call__(self, *args: str) -> Result:
        """`nonomad ARGS --token-file T --tls-ca CA` (before any `-- CMD`), with
        $NONOMAD_FLAPS set."""
        cut = args.index("--") if "--" in args else len(args)
        mine = ["--token-file", str(self.token_file), *self.tls]
        return await nonomad(*args[:cut], *mine, *args[cut:], env=self.env)


@pytest.fixture
async def cli_fleet(fleet: Fleet) -> CliFleet:
    assert fleet.security is not None
    fleet.add_worker("ams-1", "ams", "--capacity.memory-mib", "512")
    fleet.add_worker("ams-2", "ams", "--capacity.memory-mib", "512")
    fleet.add_flaps()
    cf = CliFleet(fleet, fleet.security)
    async with cf.client() as flaps:

        async def both_alive() -> bool:
            return [(r.name, r.alive_workers) for r in await flaps.list_regions()] == [("ams", 2)]

        await eventually(both_alive, 30, "both workers alive in flaps")
    return cf
