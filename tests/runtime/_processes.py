"""Running the test scripts as real processes."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def clean_env() -> dict[str, str]:
    """This process's environment without tracing or service settings that would leak in."""
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("OTEL_", "NONOMAD_", "DEMO_"))
    }


async def start_module(module: str, *args: str) -> asyncio.subprocess.Process:
    """Start `python -m module args...` from the repository root with pipes on all streams."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        *args,
        cwd=REPO_ROOT,
        env=clean_env(),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
