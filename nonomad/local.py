"""The flaps a script talks to, found as the `nonomad` CLI finds it.

    from nonomad.local import connect

    async with connect() as flaps:
        ...

$NONOMAD_FLAPS (with $NONOMAD_TOKEN, when set), else the local cluster `nonomad up` runs from
the state directory (`.nonomad/cluster` below the working directory by default): its flaps,
verified with the cluster's CA, and its admin token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nonomad.cli_common import DEFAULT_STATE_DIR, CliError
from nonomad.cli_common import connect as connect_args
from nonomad.client import Client

__all__ = ["connect"]


def connect(state_dir: str | Path = DEFAULT_STATE_DIR) -> Client:
    """A Client for the flaps the CLI would talk to; ValueError, saying why, when there is
    none (no $NONOMAD_FLAPS and no cluster runs from `state_dir`)."""
    try:
        return connect_args(argparse.Namespace(state_dir=Path(state_dir).absolute()))
    except CliError as err:
        raise ValueError(str(err)) from None
