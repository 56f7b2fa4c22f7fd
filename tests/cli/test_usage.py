"""Bad input and an unreachable flaps: one clear line on stderr and the right exit code."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc

from nonomad.cli_common import describe
from nonomad.client import ResourceExhausted
from tests.cli.conftest import Result, nonomad
from tests.cli.support import one_line_error


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_bad_input_and_an_unreachable_flaps(tmp_path: Path) -> None:
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens here
    pem = tmp_path / "client.pem"
    pem.write_text("not used")
    src = tmp_path / "src"
    src.mkdir()
    flaps = ["--flaps", nowhere]
    run = ["machines", "run", "web", "--image", "demo:v1"]
    build = ["image", "build", str(src), "--entrypoint", "x", "--out", str(tmp_path / "images"),
             "--app", "web"]  # fmt: skip
    cases: list[tuple[list[str], int, list[str]]] = [
        # what the platform would be asked, but flaps is not there
        (["machines", "list", "web", *flaps], 1,
         [f"cannot reach flaps at {nowhere}", "nonomad up"]),
        (["workers", "--json", *flaps], 1, [f"cannot reach flaps at {nowhere}"]),
        (["--state-dir", str(tmp_path / "none"), "regions"], 2,
         ["no flaps to talk to", "--flaps HOST:PORT", "NONOMAD_FLAPS", "nonomad up"]),
        # bad flags, each named
        (["machines", "list", "web", "--state", "sleeping", *flaps], 2,
         ["--state", "unknown machine state 'sleeping'"]),
        (["machines", "wait", "ams-1-x", "napping", *flaps], 2,
         ["unknown machine state 'napping'"]),
        ([*run, "--region", "ams", "--env", "NOEQUALS", *flaps], 2,
         ["--env", "'NOEQUALS' is not KEY=VALUE"]),
        ([*run, *flaps], 2, ["required: --region"]),
        # a command of its own is optional (the image's is run): never listed as required
        (["machines", "run", *flaps], 2, ["required: APP, --image, --region ("]),
        ([*run, "--region", "ams", "--memory", "lots", *flaps], 2,
         ["--memory", "'lots' is not a whole number"]),
        ([*run, "--region", "ams", "--no-start", "--wait", *flaps], 2, ["--wait and --no-start"]),
        (["machines", "list", "web", "--", "sleep", "1"], 2, ["unexpected arguments after --"]),
        (["machines", "list", "web", "--flaps", "flaps-without-port"], 2,
         ["--flaps: expected HOST:PORT"]),
        (["machines", "list", "web", *flaps, "--timeout", "0"], 2, ["--timeout: must be more"]),
        (["machines", "list", "web", *flaps, "--tls-cert", str(pem)], 2,
         ["--tls-cert and --tls-key go together"]),
        (["machines", "list", "web", *flaps, "--token-file", str(tmp_path / "no-token")], 2,
         ["--token-file: cannot read"]),
        (["regions", "--cpu", "100", *flaps], 2, ["--cpu and --memory go together"]),
        # faults are for the local cluster's workers
        (["workers", "kill", *flaps], 2, ["workers kill needs a worker ID"]),
        (["workers", "--with-machines", *flaps], 2, ["--with-machines goes with"]),
        (["workers", "nap", "ams-1", *flaps], 2, ["invalid choice: 'nap'"]),
        (["--state-dir", str(tmp_path / "none"), "workers", "pause", "ams-1"], 1,
         ["no cluster runs from", "nonomad up"]),
        ([*build, "--tag", "Not A Name:v1"], 2, ["--tag", "'Not A Name:v1'"]),
        ([*build[:2], str(tmp_path / "missing"), *build[3:], "--tag", "a:v1"], 2,
         ["is not a directory"]),
        ([*build, "--tag", "a:v1", "--workdir", "relative"], 2, ["--workdir", "not an absolute"]),
        (["--state-dir", str(tmp_path / "none"), *build[:5], "--app", "web", "--tag", "a:v1"], 2,
         ["--out: no local cluster runs", "--image-source"]),
    ]  # fmt: skip
    gate = asyncio.Semaphore(4)

    async def one(args: list[str]) -> Result:
        async with gate:
            return await nonomad(*args)

    results = await asyncio.gather(*(one(args) for args, _, _ in cases))
    for (args, code, fragments), result in zip(cases, results, strict=True):
        assert result.out == "", (args, result.out)
        one_line_error(result, code, *fragments)


def test_rejections_are_spelled_out_when_the_message_lacks_them() -> None:
    bare = ResourceExhausted(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room", "CreateMachine")
    bare.rejections = {"insufficient_cpu": 1, "insufficient_memory": 3}
    assert describe(bare, "127.0.0.1:1") == (
        "RESOURCE_EXHAUSTED: no room [rejections: insufficient_memory=3, insufficient_cpu=1]"
    )
    told = ResourceExhausted(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room (3 insufficient_memory)")
    told.rejections = {"insufficient_memory": 3}
    assert describe(told, "127.0.0.1:1") == "RESOURCE_EXHAUSTED: no room (3 insufficient_memory)"
