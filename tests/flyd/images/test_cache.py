"""The worker's image cache: eviction (least recently used, never in use) and restarts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import structlog

from flyd.images.build import build_image
from flyd.images.cache import ImageCache
from model.errors import ImageNotFound
from model.images.source import ImageSource
from tests.flyd.images.support import (
    DIGEST,
    HEX,
    FakeClock,
    file,
    images_dir_entries,
    write_layout,
)


def write_sized_images(source: Path, names: Sequence[str], size: int = 10_000) -> dict[str, str]:
    """One image per name, each holding one file of `size` bytes; returns name -> digest."""
    return {
        name: write_layout(source, name, [[file("blob", name.encode() * size)]]) for name in names
    }


def size_of(name: str, size: int = 10_000) -> int:
    return len(name.encode()) * size


async def test_eviction_drops_least_recently_used_first(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digests = write_sized_images(source, ["aa", "bb", "cc"])
    cache = make_cache(max_bytes=2 * size_of("aa"), clock=FakeClock())

    await cache.pull("aa")
    await cache.pull("bb")
    await cache.pull("aa")  # aa is now more recent than bb
    await cache.pull("cc")

    assert [c.ref for c in cache.cached()] == ["cc:latest", "aa:latest"]
    assert cache.get(digests["bb"]) is None
    assert images_dir_entries(cache.root) == sorted(
        digests[n].removeprefix("sha256:") for n in ["aa", "cc"]
    )
    assert cache.total_bytes <= cache.max_bytes


async def test_eviction_never_drops_a_referenced_image(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digests = write_sized_images(source, ["aa", "bb", "cc", "dd"])
    cache = make_cache(max_bytes=2 * size_of("aa"), clock=FakeClock())

    await cache.pull("aa")
    cache.use(digests["aa"])  # a machine runs aa
    await cache.pull("bb")
    await cache.pull("cc")  # aa is the oldest but held: bb goes
    assert {c.digest for c in cache.cached()} == {digests["aa"], digests["cc"]}

    cache.release(digests["aa"])  # the machine stops: aa is now the most recent
    await cache.pull("dd")  # so cc goes
    assert {c.digest for c in cache.cached()} == {digests["aa"], digests["dd"]}


async def test_cache_stays_over_its_bound_when_everything_is_in_use(
    source: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digests = write_sized_images(source, ["aa", "bb", "cc"])
    cache = make_cache(max_bytes=size_of("aa"), clock=FakeClock())

    for name in ["aa", "bb"]:
        await cache.pull(name)
        cache.use(digests[name])
    with structlog.testing.capture_logs() as logs:
        image = await cache.pull("cc")

    # The new image itself is kept even though it alone fills the cache: its caller is about
    # to use it.
    assert {c.digest for c in cache.cached()} == set(digests.values())
    assert image.rootfs.is_dir()
    assert cache.total_bytes > cache.max_bytes
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["image_cache_over_bound"]
    assert [(c.digest, c.refs) for c in cache.cached() if c.refs] == [
        (digests["bb"], 1),
        (digests["aa"], 1),
    ]


async def test_use_of_an_unknown_image_fails(make_cache: Callable[..., ImageCache]) -> None:
    cache = make_cache()
    with pytest.raises(ImageNotFound):
        cache.use(DIGEST)
    cache.release(DIGEST)  # harmless
    assert cache.get(DIGEST) is None


async def test_restart_keeps_the_cache(
    source: Path, cache_root: Path, tmp_path: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digests = write_sized_images(source, ["aa", "bb", "cc"])
    clock = FakeClock()
    cache = make_cache(max_bytes=2 * size_of("aa"), clock=clock)
    await cache.pull("aa")
    await cache.pull("bb")
    await cache.pull("aa")
    before = cache.cached()
    cache.flush()  # as flyd does periodically and on shutdown: recency is only a hint
    # A crash mid-unpack left a scratch directory behind.
    scratch = cache_root / "images" / f".tmp-{HEX}-dead"
    (scratch / "rootfs").mkdir(parents=True)

    # flyd restarts; the source is now somewhere else entirely.
    empty = tmp_path / "empty"
    empty.mkdir()
    restarted = ImageCache(cache_root, ImageSource(empty), max_bytes=2 * size_of("aa"), clock=clock)

    assert restarted.cached() == before
    assert not scratch.exists()
    image = restarted.get(digests["aa"])
    assert image is not None
    assert (image.rootfs / "blob").read_bytes() == b"aa" * 10_000
    again = await restarted.pull("aa")
    assert (again.digest, again.pulled) == (digests["aa"], False)

    # Recency survived too: bb is still the least recently used.
    restarted.source = ImageSource(source)
    await restarted.pull("cc")
    assert {c.digest for c in restarted.cached()} == {digests["aa"], digests["cc"]}


async def test_recency_is_saved_by_flush_not_by_every_use(
    source: Path, cache_root: Path, make_cache: Callable[..., ImageCache]
) -> None:
    digests = write_sized_images(source, ["aa"])
    cache = make_cache(max_bytes=10 * size_of("aa"))
    await cache.pull("aa")
    saved = (cache_root / "index.json").read_bytes()
    cache.use(digests["aa"])
    cache.release(digests["aa"])
    await cache.pull("aa")  # a hit
    assert (cache_root / "index.json").read_bytes() == saved
    cache.flush()
    assert (cache_root / "index.json").read_bytes() != saved


async def test_a_rebuilt_tag_is_seen_without_rereading_an_unchanged_source(
    source: Path, make_cache: Callable[..., ImageCache], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("one")
    first = build_image(src, source, name="app", tag="v1", entrypoint=["x"])
    cache = make_cache(max_bytes=1 << 30)
    assert (await cache.pull("app:v1")).digest == first
    assert (await cache.pull("app:v1")).digest == first
    (src / "f").write_text("two")
    second = build_image(src, source, name="app", tag="v1", entrypoint=["x"])
    assert second != first
    assert (await cache.pull("app:v1")).digest == second
