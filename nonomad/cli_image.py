"""`nonomad image build`: a directory as an OCI image in the workers' image source; `image
list`: what a source holds, and who may run each image."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from flyd.images.build import build_image
from model.errors import FlydError, ImageError
from model.errors import InvalidArgument as FlydInvalidArgument
from model.images.owners import Owners
from model.images.reference import parse_reference
from model.images.source import ImageSource
from nonomad.cli_common import CliError, UsageError, emit, local_cluster, state_dir, table


def argv(flag: str, value: str | None) -> list[str]:
    """A command given as a JSON array or a shell-like string."""
    if not value:
        return []
    if value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            raise UsageError(f"{flag}: not a JSON array of strings ({err.msg})") from None
        if not isinstance(parsed, list) or not all(isinstance(a, str) for a in parsed):
            raise UsageError(f"{flag}: not a JSON array of strings")
        return parsed
    try:
        return shlex.split(value)
    except ValueError as err:
        raise UsageError(f"{flag}: {err}") from None


def tree_size(root: Path) -> tuple[int, int]:
    """Files and bytes under `root`, as the build will see them (symlinks not followed)."""
    files = total = 0
    for parent, _, names in os.walk(root):
        for name in names:
            files += 1
            total += os.lstat(os.path.join(parent, name)).st_size
    return files, total


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def layer_bytes(out: Path, name: str, digest: str) -> int:
    """The size of the image's layers (compressed, the base's too), from its manifest."""
    manifest = out.joinpath(*name.split("/"), "blobs", "sha256", digest.removeprefix("sha256:"))
    return sum(int(layer["size"]) for layer in json.loads(manifest.read_text())["layers"])


def owners_of(args: argparse.Namespace) -> Owners:
    """Who may run the image, from --app, --share-with and --public: one of --app and
    --public is needed (an image that records no owner runs for no one)."""
    if args.share_with and args.app is None:
        raise UsageError("--share-with: an image shared with other apps needs its own --app")
    if args.app is None and not args.public:
        raise UsageError(
            "--app: say which app the image is for (--app APP, and --share-with A,B for "
            "others that may run it), or --public for every app"
        )
    try:
        return Owners.of(args.app or "", args.share_with, public=args.public)
    except ValueError as err:
        raise UsageError(f"--app: {err}") from None


def cmd_build(args: argparse.Namespace) -> int:
    try:
        ref = parse_reference(args.tag)
    except FlydError as err:
        raise UsageError(f"--tag: {err}") from None
    if ref.digest is not None or ref.tag is None:
        raise UsageError(f"--tag: {args.tag!r} must be NAME:TAG, not a digest")
    owners = owners_of(args)
    src = Path(args.dir)
    if not src.is_dir():
        raise UsageError(f"DIR: {src} is not a directory")
    out = args.out
    cluster = local_cluster(state_dir(args))
    if out is None:
        if cluster is None:
            raise UsageError(
                "--out: no local cluster runs, so give the image source directory your "
                "workers pull from (their flyd --image-source)"
            )
        out = Path(cluster.image_source)
    entrypoint = argv("--entrypoint", args.entrypoint)
    cmd = argv("--cmd", args.cmd)
    if not entrypoint and not cmd:
        raise UsageError("--entrypoint or --cmd: an image needs a command to run")

    files, size = tree_size(src)
    tty = sys.stderr.isatty() and not args.json
    if tty:
        print(
            f"building {ref} from {src} ({plural(files, 'file')}, {human_bytes(size)})...",
            file=sys.stderr,
        )
    started = time.monotonic()
    try:
        digest = build_image(
            src,
            out,
            name=ref.name,
            tag=ref.tag,
            entrypoint=entrypoint,
            cmd=cmd,
            env=dict(args.env),
            workdir=args.workdir,
            base=args.base,
            ports=args.port,
            owners=owners,
        )
    except FlydInvalidArgument as err:
        raise UsageError(f"--{err.field}: {str(err).partition(': ')[2]}") from None
    except ImageError as err:
        raise UsageError(str(err)) from None
    except OSError as err:
        raise CliError(f"cannot build {ref} into {out}: {err}") from None
    seconds = time.monotonic() - started
    layer = layer_bytes(out, ref.name, digest)
    report = {
        "image": str(ref),
        "digest": digest,
        "out": str(Path(out).absolute()),
        "files": files,
        "bytes": size,
        "layer_bytes": layer,
        "seconds": round(seconds, 3),
        "owner": owners.app or None,
        "shared_with": sorted(owners.shared_with),
        "public": owners.public,
    }

    def human() -> str:
        line = (
            f"built {ref} in {seconds:.2f} s: {plural(files, 'file')}, {human_bytes(size)} "
            f"({human_bytes(layer)} compressed), digest {digest}\ninto {report['out']}"
            f"\nwho may run it: {owners}"
        )
        if cluster is not None and Path(cluster.image_source).absolute() == Path(out).absolute():
            line += f"\nthe local cluster can run it: nonomad machines run APP --image {ref} ..."
        return line

    emit(args, report, human)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    root = args.source
    if root is None:
        cluster = local_cluster(state_dir(args))
        if cluster is None:
            raise UsageError(
                "--source: no local cluster runs, so give the image source directory (the "
                "workers' flyd --image-source)"
            )
        root = Path(cluster.image_source)
    if not Path(root).is_dir():
        raise UsageError(f"--source: {root} is not a directory")
    source = ImageSource(root)
    listed: list[dict[str, object]] = []
    for ref in source.tagged():
        row: dict[str, object] = {"image": ref}
        try:
            resolved = source.resolve(ref)
            owners = resolved.owners()
        except (ImageError, OSError) as err:  # listed all the same: a worker says this
            row.update(digest=None, owner=None, shared_with=[], public=False, error=str(err))
        else:
            row.update(
                digest=resolved.digest,
                owner=owners.app or None,
                shared_with=sorted(owners.shared_with),
                public=owners.public,
                error=None,
                who=str(owners) if owners.app or owners.public else "no app (no owner recorded)",
            )
        listed.append(row)

    def human() -> str:
        rows = [
            (r["image"], str(r["digest"] or "-")[:19], r.get("who") or f"unreadable: {r['error']}")
            for r in listed
        ]
        return (
            table(rows, ["IMAGE", "DIGEST", "WHO MAY RUN IT"]) if rows else f"no images in {root}"
        )

    emit(args, [{k: v for k, v in r.items() if k != "who"} for r in listed], human)
    return 0
