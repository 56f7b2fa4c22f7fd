"""Helpers for deploy tests: specs as dicts (and as TOML files), the CLI in-process."""

from __future__ import annotations

import argparse
import asyncio
import copy
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from nonomad.cli import parse_args
from nonomad.cli_deploy import run
from nonomad.client import Client, Machine
from nonomad.spec import AppSpec, parse_spec

# Fast checks; a generous grace, so a machine slow to start on a busy host still passes.
BASE: dict[str, Any] = {
    "app": "web",
    "image": "demo:v1",
    "standbys": 1,
    "regions": {"ams": 2},
    "guest": {"cpu_millicores": 100, "memory_mib": 64},
    "services": [{"internal_port": 8080, "autostart": True}],
    "checks": [
        {"name": "root", "type": "http", "path": "/", "interval": "100ms", "grace_period": "30s"}
    ],
    "restart": {"policy": "always"},
}


def spec_data(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data.update(changes)
    return data


def make_spec(**changes: Any) -> AppSpec:
    return parse_spec(spec_data(**changes))


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def to_toml(data: dict[str, Any]) -> str:
    """Our spec dicts as TOML: scalars first, then tables, then arrays of tables."""
    lines = [f"{k} = {_value(v)}" for k, v in data.items() if not isinstance(v, dict | list)]
    for key, value in data.items():
        if isinstance(value, dict):
            lines += ["", f"[{key}]", *(f"{k} = {_value(v)}" for k, v in value.items())]
    for key, value in data.items():
        if isinstance(value, list):
            for item in value:
                lines += ["", f"[[{key}]]", *(f"{k} = {_value(v)}" for k, v in item.items())]
    return "\n".join(lines) + "\n"


def write_spec(tmp: Path, data: dict[str, Any], name: str = "app.toml") -> Path:
    path = tmp / name
    path.write_text(to_toml(data))
    return path


def cli_args(path: Path, *flags: str) -> argparse.Namespace:
    """Parse `deploy PATH FLAGS` with nonomad's own command line."""
    return parse_args(["deploy", str(path), *flags])


async def run_cli(
    client: Client, path: Path, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what came before
    code = await run(cli_args(path, *flags), client)
    out, err = capsys.readouterr()
    return code, out, err


async def http_get(machine: Machine) -> str:
    """The body the machine's first service answers on its host port."""
    port = machine.ports[0]

    def get() -> str:
        url = f"http://{port.host}:{port.host_port}/"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return str(resp.read().decode())

    return await asyncio.to_thread(get)


async def by_name(client: Client, app: str = "web") -> dict[str, Machine]:
    return {m.name: m for m in await client.list_machines(app)}
