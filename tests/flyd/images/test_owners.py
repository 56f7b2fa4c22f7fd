"""Who may run an image: the rule (model.images.owners), what a build records, and the cache
applying it before it unpacks anything."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from flyd.images.build import build_image
from flyd.images.cache import ImageCache
from model.errors import ImageDenied, ImageError
from model.images.owners import (
    NO_OWNER,
    OWNER_ANNOTATION,
    PUBLIC,
    PUBLIC_ANNOTATION,
    SHARED_ANNOTATION,
    Owners,
)
from model.images.source import ImageSource
from tests.flyd.images.support import blob_json, images_dir_entries

DEMO = Owners.of("demo")
SHARED = Owners.of("demo", ["web", "api"])


@pytest.mark.parametrize(
    ("owners", "app", "allowed"),
    [
        (DEMO, "demo", True),
        (DEMO, "bapp", False),  # the attack: another app's image
        (SHARED, "web", True),
        (SHARED, "api", True),
        (SHARED, "bapp", False),
        (PUBLIC, "bapp", True),
        (Owners.of("demo", public=True), "bapp", True),
        (NO_OWNER, "demo", False),  # recorded for no one: for no one
        (NO_OWNER, "bapp", False),
    ],
)
def test_an_image_is_its_owners_its_shares_and_if_public_everyones(
    owners: Owners, app: str, allowed: bool
) -> None:
    assert owners.allows(app) is allowed
    assert (owners.refusal(app, "demo:v1") is None) is allowed


def test_a_refusal_names_the_image_its_owner_and_the_app() -> None:
    assert DEMO.refusal("bapp", "demo:v1") == (
        "image 'demo:v1' is app demo's and not shared with app bapp"
    )
    assert NO_OWNER.refusal("bapp", "stray:v1") == (
        "image 'stray:v1' records no owner and is not public: the operator builds it for an app "
        "with `nonomad image build --app APP` (or `--public`)"
    )


@pytest.mark.parametrize(
    "owners", [DEMO, SHARED, PUBLIC, NO_OWNER, Owners.of("demo", ["web"], public=True)]
)
def test_owners_round_trip_through_annotations(owners: Owners) -> None:
    assert Owners.parse(owners.annotations(), "here") == owners


@pytest.mark.parametrize(
    ("annotations", "says"),
    [
        ({PUBLIC_ANNOTATION: "yes"}, "is 'yes', not true or false"),
        ({OWNER_ANNOTATION: "Demo"}, "'Demo' is not an app name"),
        ({OWNER_ANNOTATION: "demo", SHARED_ANNOTATION: "web,-x"}, "'-x' is not an app name"),
        ({SHARED_ANNOTATION: "web"}, "shared with other apps needs an owner app"),
        (
            {OWNER_ANNOTATION: "demo", SHARED_ANNOTATION: ",".join(f"a{i}" for i in range(65))},
            "shared with 65 apps; at most 64",
        ),
    ],
)
def test_unclear_owners_are_an_image_error(annotations: dict[str, str], says: str) -> None:
    with pytest.raises(ImageError, match="manifest sha256:x: ") as caught:
        Owners.parse(annotations, "manifest sha256:x")
    assert says in str(caught.value)


def test_the_owner_is_not_among_its_own_shares() -> None:
    assert Owners.of("demo", ["demo", "web"]).shared_with == {"web"}
    assert str(SHARED) == "app demo, shared with api, web"
    assert (str(PUBLIC), str(NO_OWNER)) == ("public", "no owner")


# -- what a build records -------------------------------------------------------------------


def test_a_build_records_its_owners_in_the_manifest_so_they_are_part_of_its_digest(
    app_dir: Path, source: Path
) -> None:
    plain = build_image(app_dir, source, name="app", tag="plain", entrypoint=["/bin/app"])
    demo = build_image(
        app_dir, source, name="app", tag="demo", entrypoint=["/bin/app"], owners=DEMO
    )
    shared = build_image(
        app_dir, source, name="app", tag="shared", entrypoint=["/bin/app"], owners=SHARED
    )
    layout = source / "app"
    assert "annotations" not in blob_json(layout, plain)  # no owner: nothing recorded
    assert blob_json(layout, demo)["annotations"] == {OWNER_ANNOTATION: "demo"}
    assert blob_json(layout, shared)["annotations"] == {
        OWNER_ANNOTATION: "demo",
        SHARED_ANNOTATION: "api,web",
    }
    assert len({plain, demo, shared}) == 3  # the same tree, three images
    resolved = ImageSource(source).resolve("app:shared")
    assert resolved.owners() == SHARED


# -- the cache: checked before anything is unpacked -----------------------------------------


@pytest.fixture
def images(app_dir: Path, source: Path) -> dict[str, str]:
    """demo:v1 (app demo's), shared:v1 (demo's, shared with web and api), pub:v1 (public),
    stray:v1 (no owner recorded): ref -> digest."""
    made = {}
    for name, owners in [("demo", DEMO), ("shared", SHARED), ("pub", PUBLIC), ("stray", NO_OWNER)]:
        digest = build_image(
            app_dir, source, name=name, tag="v1", entrypoint=["/bin/app"], owners=owners
        )
        made[f"{name}:v1"] = digest
    return made


@pytest.mark.parametrize(
    ("ref", "app"),
    [("demo:v1", "bapp"), ("shared:v1", "bapp"), ("stray:v1", "demo"), ("demo:v1", "web")],
)
async def test_a_pull_for_an_app_the_image_is_not_for_unpacks_nothing(
    images: dict[str, str], make_cache: Callable[..., ImageCache], ref: str, app: str
) -> None:
    cache = make_cache()
    with pytest.raises(ImageDenied) as caught:
        await cache.pull(ref, app=app)
    assert caught.value.image == ref
    assert str(caught.value).startswith("config.image: image ")
    assert (cache.pulls, cache.cached(), images_dir_entries(cache.root)) == (0, [], [])


@pytest.mark.parametrize(
    ("ref", "app"),
    [("demo:v1", "demo"), ("shared:v1", "web"), ("shared:v1", "api"), ("pub:v1", "bapp")],
)
async def test_a_pull_for_an_app_the_image_is_for_unpacks_it(
    images: dict[str, str], make_cache: Callable[..., ImageCache], ref: str, app: str
) -> None:
    cache = make_cache()
    image = await cache.pull(ref, app=app)
    assert (image.digest, image.pulled, cache.pulls) == (images[ref], True, 1)
    # By digest too: the digest names the manifest, and the manifest the owners.
    name = ref.partition(":")[0]
    assert (await cache.pull(f"{name}@{images[ref]}", app=app)).digest == images[ref]


async def test_a_cached_image_keeps_its_owners_when_the_source_loses_it(
    images: dict[str, str], source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    cache = make_cache()
    await cache.pull("demo:v1", app="demo")
    shutil.rmtree(source / "demo")  # the source no longer has it: the cache's copy serves
    assert (await cache.pull("demo:v1", app="demo")).digest == images["demo:v1"]
    with pytest.raises(ImageDenied):
        await cache.pull("demo:v1", app="bapp")
    restarted = make_cache()  # and after a restart, from image.json
    with pytest.raises(ImageDenied):
        await restarted.pull(f"demo@{images['demo:v1']}", app="bapp")
    assert (await restarted.pull(f"demo@{images['demo:v1']}", app="demo")).pulled is False


async def test_an_entry_cached_before_owners_were_kept_learns_them_from_the_source(
    images: dict[str, str], cache_root: Path, make_cache: Callable[..., ImageCache]
) -> None:
    await make_cache().pull("demo:v1", app="demo")
    meta_path = cache_root / "images" / images["demo:v1"].removeprefix("sha256:") / "image.json"
    meta = json.loads(meta_path.read_text())
    del meta["owners"]  # as an older flyd wrote it
    meta_path.write_text(json.dumps(meta))

    cache = make_cache()
    with pytest.raises(ImageDenied):
        await cache.pull("demo:v1", app="bapp")
    assert json.loads(meta_path.read_text())["owners"] == {
        "app": "demo",
        "public": False,
        "shared_with": [],
    }
    assert (await cache.pull("demo:v1", app="demo")).pulled is False  # never unpacked again
    assert cache.pulls == 0
