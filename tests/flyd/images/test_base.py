"""Building on a base: a rootfs tar (gzip, xz or plain), an OCI layout or a `docker save`
archive under the directory's layer; the result pulls and unpacks like any image, has the
base's files and run config, and says it needs nothing of the host.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from flyd.images.build import build_image
from flyd.images.cache import ImageCache
from model.errors import ImageError
from tests.flyd.images.support import blob_json, file, tar_bytes


def rootfs_tar() -> bytes:
    """A tiny distribution: a shell, an os-release and a user."""
    return tar_bytes(
        [
            file("bin/sh", b"#!fake shell\n", 0o755),
            file("etc/os-release", b"ID=tiny\n"),
            file("etc/passwd", b"root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/app:/bin/sh\n"),
        ]
    )


@pytest.fixture
def app(tmp_path: Path) -> Path:
    src = tmp_path / "app"
    src.mkdir()
    (src / "app.py").write_text("print('hi')\n")
    return src


def build_on(app: Path, source: Path, base: Path, **kwargs: object) -> str:
    return build_image(
        app,
        source,
        name="app",
        tag="v1",
        entrypoint=["python3", "app.py"],
        base=base,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    "compress",
    [lambda b: b, gzip.compress, lzma.compress],
    ids=["tar", "gzip", "xz"],
)
async def test_a_rootfs_tar_is_the_layer_under_the_directory(
    tmp_path: Path,
    source: Path,
    app: Path,
    make_cache: Callable[..., ImageCache],
    compress: Callable[[bytes], bytes],
) -> None:
    base = tmp_path / "tiny.tar"
    base.write_bytes(compress(rootfs_tar()))
    digest = build_on(app, source, base, env={"MODE": "prod"})

    manifest = blob_json(source / "app", digest)
    assert len(manifest["layers"]) == 2
    image = await make_cache().pull("app:v1")
    assert (image.rootfs / "etc" / "os-release").read_text() == "ID=tiny\n"
    assert (image.rootfs / "app.py").read_text() == "print('hi')\n"
    assert not image.host_runtime  # it has an OS of its own
    assert image.env["MODE"] == "prod"
    assert image.env["PATH"].startswith("/usr/local/sbin")
    # Built again from the same base: the same digest.
    assert build_on(app, source, base, env={"MODE": "prod"}) == digest


async def test_an_oci_layout_base_lends_its_layers_and_run_config(
    tmp_path: Path, source: Path, app: Path, make_cache: Callable[..., ImageCache]
) -> None:
    tiny = tmp_path / "tiny.tar"
    tiny.write_bytes(rootfs_tar())
    layouts = tmp_path / "bases"
    build_image(
        app,
        layouts,
        name="tiny",
        tag="latest",
        entrypoint=["/bin/sh"],
        base=tiny,
        env={"LANG": "C.UTF-8"},
        workdir="/app",
    )
    base = layouts / "tiny"
    digest = build_on(app, source, base, env={"MODE": "prod"})

    config = blob_json(source / "app", blob_json(source / "app", digest)["config"]["digest"])
    assert config["config"]["WorkingDir"] == "/app"  # the base's, not given here
    assert config["config"]["Entrypoint"] == ["python3", "app.py"]
    assert sorted(config["config"]["Env"])[:1] == ["LANG=C.UTF-8"]
    assert len(config["rootfs"]["diff_ids"]) == 3  # tiny, the base's app, this app
    image = await make_cache().pull("app:v1")
    assert (image.rootfs / "etc" / "os-release").read_text() == "ID=tiny\n"
    assert image.workdir == "/app"


async def test_a_docker_save_archive_is_a_base(
    tmp_path: Path, source: Path, app: Path, make_cache: Callable[..., ImageCache]
) -> None:
    layer = rootfs_tar()
    diff_id = f"sha256:{hashlib.sha256(layer).hexdigest()}"
    config = {
        "config": {"Env": ["PATH=/bin"], "User": "app"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    archive = tmp_path / "saved.tar"
    with tarfile.open(archive, "w") as tf:
        for name, data in (
            ("manifest.json", json.dumps([{"Config": "c.json", "Layers": ["l/layer.tar"]}])),
            ("c.json", json.dumps(config)),
            ("l/layer.tar", layer),
        ):
            raw = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))
    build_on(app, source, archive)
    image = await make_cache().pull("app:v1")
    assert (image.rootfs / "bin" / "sh").exists()
    assert image.user == "app"


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p.mkdir(), "must be an OCI image layout"),
        (lambda p: p.write_bytes(b"not a tar at all" * 100), "not a readable tar"),
        (lambda p: None, "no such file"),
    ],
    ids=["plain directory", "garbage", "missing"],
)
def test_a_base_that_is_none_is_refused(
    tmp_path: Path, source: Path, app: Path, make: Callable[[Path], None], says: str
) -> None:
    base = tmp_path / "base"
    make(base)
    with pytest.raises(ImageError, match=says):
        build_on(app, source, base)
    assert not (source / "app" / "index.json").exists()  # nothing was tagged
