"""`nonomad image build`, then `machines run` of the built image on a real fleet: by its app,
and by the apps it is shared with; another app's run is refused."""

from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flyd.images.build import build_image
from nonomad.cli_common import LocalCluster
from tests.cli.conftest import CliFleet, nonomad
from tests.harness import clean_env

SITE = """\
import http.server, os

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = open("static/greeting.txt").read().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

print("serving on", os.environ["PORT"], flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["PORT"])), Handler).serve_forever()
"""


def get(url: str, deadline: float = 30) -> str:
    """GET url once the machine listens (it has just been started)."""
    stop = time.monotonic() + deadline
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return str(resp.read().decode())
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > stop:
                raise
        time.sleep(0.05)


async def test_an_image_built_by_the_cli_runs_on_the_fleet(
    cli_fleet: CliFleet, tmp_path: Path
) -> None:
    src = tmp_path / "site"
    (src / "static").mkdir(parents=True)
    (src / "app.py").write_text(SITE)
    (src / "static" / "greeting.txt").write_text("built by nonomad image build\n")
    images = cli_fleet.fleet.image_source  # the directory the fleet's workers pull from

    built = (
        await nonomad(
            "image", "build", str(src), "--tag", "cli-site:v1", "--app", "site",
            "--entrypoint", "python3 -u app.py", "--env", "WHO=cli", "--out", str(images),
            "--json",
        )
    ).json()  # fmt: skip
    assert built["image"] == "cli-site:v1"
    assert (built["owner"], built["shared_with"], built["public"]) == ("site", [], False)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", built["digest"])
    assert (built["out"], built["files"]) == (str(images), 2)
    assert built["bytes"] == len(SITE) + len("built by nonomad image build\n")
    assert built["layer_bytes"] > 0
    # The build is deterministic: the same tree and arguments give the same digest.
    again = await nonomad(
        "image", "build", str(src), "--tag", "cli-site:v1", "--app", "site",
        "--entrypoint", '["python3", "-u", "app.py"]', "--env", "WHO=cli", "--out", str(images),
    )  # fmt: skip
    assert again.code == 0, again.err
    assert again.out.startswith("built cli-site:v1 in ")
    assert f"digest {built['digest']}" in again.out
    assert again.out.endswith("\nwho may run it: app site\n")

    # A local cluster's record (what `nonomad up` writes) makes --out, --flaps and the TLS and
    # token flags optional: the CLI finds the flaps, its CA and the admin token there.
    state = tmp_path / "cluster"
    state.mkdir()
    LocalCluster(
        flaps=cli_fleet.address,
        proxy="",
        http="",
        image_source=str(images),
        ca=str(cli_fleet.security.ca),
        token_file=str(cli_fleet.token_file),
    ).save(state)
    (state / "up.pid").write_text(str(os.getpid()))
    local = ["--state-dir", str(state)]
    v2 = await nonomad(
        *local, "image", "build", str(src), "--tag", "cli-site:v2", "--cmd", "python3 -u app.py",
        "--app", "site", "--share-with", "blog", env=clean_env(),
    )  # fmt: skip
    assert v2.code == 0, v2.err
    assert f"into {images}" in v2.out
    assert "the local cluster can run it: nonomad machines run APP --image cli-site:v2" in v2.out
    assert "who may run it: app site, shared with blog" in v2.out

    # Another app's machine of it is refused, before any worker is asked, and nothing is made.
    other = await nonomad(
        *local, "machines", "run", "bapp", "--image", "cli-site:v2", "--region", "ams",
        "--port", "8080", "--memory", "64", env=clean_env(),
    )  # fmt: skip
    assert other.code == 1, other.out
    assert "config.image: image 'cli-site:v2' is app site's and not shared with app bapp" in (
        other.err
    )
    listed = await nonomad(*local, "machines", "list", "bapp", "--json", env=clean_env())
    assert listed.json() == []

    run = await nonomad(
        *local, "machines", "run", "site", "--image", "cli-site:v2", "--region", "ams",
        "--port", "8080", "--memory", "64", "--wait", env=clean_env(),
    )  # fmt: skip
    assert run.code == 0, run.err
    found = re.fullmatch(
        r"(ams-\d-\w+) in ams on ams-\d: started\nports: 8080->127\.0\.0\.1:(\d+)\n", run.out
    )
    assert found, run.out
    body = await asyncio.to_thread(get, f"http://127.0.0.1:{found.group(2)}/")
    assert body == "built by nonomad image build\n"

    # `--port` says where the command serves: `machines run` without --port publishes it. The
    # app it is shared with (blog) runs it as its owner does.
    v3 = await nonomad(
        *local, "image", "build", str(src), "--tag", "cli-site:v3", "--cmd", "python3 -u app.py",
        "--port", "8080", "--app", "site", "--share-with", "blog", "--json", env=clean_env(),
    )  # fmt: skip
    assert v3.code == 0, v3.err
    published = await nonomad(
        *local, "machines", "run", "blog", "--image", "cli-site:v3", "--region", "ams",
        "--memory", "64", "--wait", env=clean_env(),
    )  # fmt: skip
    assert published.code == 0, published.err
    found = re.search(r"ports: 8080->127\.0\.0\.1:(\d+)", published.out)
    assert found, published.out
    body = await asyncio.to_thread(get, f"http://127.0.0.1:{found.group(1)}/")
    assert body == "built by nonomad image build\n"
    bad = await nonomad(
        *local, "image", "build", str(src), "--tag", "cli-site:v4", "--cmd", "true",
        "--port", "70000", "--public", env=clean_env(),
    )  # fmt: skip
    assert bad.code == 2
    assert "--port" in bad.err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ([], "--app: say which app the image is for"),
        (["--share-with", "blog"], "--share-with: an image shared with other apps needs its own"),
        (["--app", "Site"], "--app: 'Site' is not an app name"),
        (["--app", "site", "--share-with", "blog,-x"], "'-x' is not an app name"),
    ],
)
async def test_a_build_must_say_whose_image_it_is_and_writes_nothing_until_it_does(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    src = tmp_path / "site"
    src.mkdir()
    (src / "app.py").write_text(SITE)
    out = tmp_path / "images"
    bad = await nonomad(
        "image", "build", str(src), "--tag", "site:v1", "--cmd", "true", "--out", str(out), *flags
    )
    assert bad.code == 2, bad.out
    assert says in bad.err
    assert not out.exists()


async def test_image_list_shows_who_may_run_each_image_of_the_source(tmp_path: Path) -> None:
    src = tmp_path / "site"
    src.mkdir()
    (src / "app.py").write_text(SITE)
    images = tmp_path / "images"
    for tag, flags in [
        ("demo:v1", ["--app", "demo"]),
        ("team/site:v2", ["--app", "site", "--share-with", "blog,docs"]),
        ("base:v1", ["--public"]),
    ]:
        built = await nonomad(
            "image", "build", str(src), "--tag", tag, "--cmd", "true", "--out", str(images), *flags
        )
        assert built.code == 0, built.err
    build_image(src, images, name="stray", tag="v1", entrypoint=["true"])  # as before owners
    (images / "broken").mkdir()
    (images / "broken" / "index.json").write_text("{")

    listed = (await nonomad("image", "list", "--source", str(images), "--json")).json()
    assert [(r["image"], r["owner"], r["shared_with"], r["public"]) for r in listed] == [
        ("base:v1", None, [], True),
        ("broken", None, [], False),
        ("demo:v1", "demo", [], False),
        ("stray:v1", None, [], False),
        ("team/site:v2", "site", ["blog", "docs"], False),
    ]
    assert "is not valid JSON" in listed[1]["error"]
    assert all(r["error"] is None for r in listed if r["image"] != "broken")
    human = await nonomad("image", "list", "--source", str(images))
    lines = {line.split()[0]: line for line in human.out.splitlines()[1:]}
    assert lines["demo:v1"].endswith("app demo")
    assert lines["team/site:v2"].endswith("app site, shared with blog, docs")
    assert lines["base:v1"].endswith("public")
    assert lines["stray:v1"].endswith("no app (no owner recorded)")
    nowhere = await nonomad("--state-dir", str(tmp_path / "none"), "image", "list", env=clean_env())
    assert (nowhere.code, "--source: no local cluster runs" in nowhere.err) == (2, True)
