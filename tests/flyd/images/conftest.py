"""Fixtures of the image tests: an image source directory, a cache over it, a test app."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flyd.images.cache import ImageCache
from model.images.source import ImageSource


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "source"
    root.mkdir()
    return root


@pytest.fixture
def cache_root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def make_cache(source: Path, cache_root: Path) -> Callable[..., ImageCache]:
    def make(**kwargs: Any) -> ImageCache:
        kwargs.setdefault("max_bytes", 1 << 30)
        return ImageCache(cache_root, ImageSource(source), **kwargs)

    return make


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    src = tmp_path / "app"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "app").write_text("#!/bin/sh\necho hello\n")
    (src / "bin" / "app").chmod(0o755)
    (src / "bin" / "run").symlink_to("app")
    (src / "bin" / "privileged").write_text("#!/bin/sh\n")
    (src / "bin" / "privileged").chmod(0o4755)
    (src / "etc").mkdir()
    (src / "etc" / "app.conf").write_text("port=8080\n")
    (src / "etc" / "app.conf").chmod(0o640)
    (src / "shell").symlink_to("/bin/sh")
    (src / "empty").mkdir()
    return src
