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
from tests.flaps.conftest import Fleet, eventually, fleet
from tests.harness import REPO_ROOT, clean_env

__all__ = ["CliFleet", "Result", "cli_fleet", "fleet", "nonomad"]

NONOMAD = [sys.executable, "-m", "nonomad.cli"]
TOKEN = "cli-test-token"


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
    import time

    t0 = time.monotonic()
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
    print(f"TIMING {time.monotonic() - t0:.2f} {args[:4]}")
    return Result(proc.returncode, out.decode(), err.decode())


@dataclass
class CliFleet:
    """Two workers in ams and a token-protected flaps, named to the CLI by $NONOMAD_FLAPS."""

    fleet: Fleet
    token_file: Path

    @property
    def address(self) -> str:
        return self.fleet.flaps[0].address

    @property
    def env(self) -> dict[str, str]:
        return clean_env(NONOMAD_FLAPS=self.address)

    def client(self) -> Client:
        return Client(self.address, token_file=self.token_file, timeout=20)

    async def __call__(self, *args: str) -> Result:
        """`nonomad ARGS --token-file T` (before any `-- CMD`), with $NONOMAD_FLAPS set."""
        cut = args.index("--") if "--" in args else len(args)
        return await nonomad(
            *args[:cut], "--token-file", str(self.token_file), *args[cut:], env=self.env
        )


@pytest.fixture
async def cli_fleet(fleet: Fleet, tmp_path: Path) -> CliFleet:
    token = tmp_path / "token"
    token.write_text(f"{TOKEN}\n")
    fleet.add_worker("ams-1", "ams", "--capacity.memory-mib", "512")
    fleet.add_worker("ams-2", "ams", "--capacity.memory-mib", "512")
    fleet.add_flaps("--auth-token-file", str(token))
    cf = CliFleet(fleet, token)
    async with cf.client() as flaps:

        async def both_alive() -> bool:
            return [(r.name, r.alive_workers) for r in await flaps.list_regions()] == [("ams", 2)]

        await eventually(both_alive, 30, "both workers alive in flaps")
    return cf
