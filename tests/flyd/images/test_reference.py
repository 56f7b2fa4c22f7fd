"""Image references: what parses, and the named error for what does not."""

from __future__ import annotations

import pytest

from model.errors import (
    InvalidArgument,
    InvalidImageReference,
)
from model.images.reference import ImageRef, parse_reference
from tests.flyd.images.support import (
    DIGEST,
    HEX,
)


@pytest.mark.parametrize(
    ("ref", "expected", "text"),
    [
        ("app", ImageRef("app", tag="latest"), "app:latest"),
        ("app:v1", ImageRef("app", tag="v1"), "app:v1"),
        ("acme/app:1.2.3", ImageRef("acme/app", tag="1.2.3"), "acme/app:1.2.3"),
        ("a.b_c-d/e0/f:_Tag-9.x", ImageRef("a.b_c-d/e0/f", tag="_Tag-9.x"), None),
        ("app:" + "t" * 128, ImageRef("app", tag="t" * 128), None),
        (f"acme/app@{DIGEST}", ImageRef("acme/app", digest=DIGEST), None),
    ],
)
def test_parse_valid_reference(ref: str, expected: ImageRef, text: str | None) -> None:
    parsed = parse_reference(ref)
    assert parsed == expected
    assert str(parsed) == (text or ref)


@pytest.mark.parametrize(
    ("ref", "complaint"),
    [
        ("", "empty"),
        (":v1", "name is empty"),
        ("App", "component 'App'"),
        ("acme//app", "empty path component"),
        ("/app", "empty path component"),
        ("app/", "empty path component"),
        ("app..x", "component 'app..x'"),
        ("-app", "component '-app'"),
        ("app_", "component 'app_'"),
        (" app", "component ' app'"),
        ("a" * 256, "longer than 255"),
        ("app:", "tag is empty"),
        ("app:-v1", "tag '-v1'"),
        ("app:.v1", "tag '.v1'"),
        ("app:v1:v2", "tag 'v1:v2'"),
        ("app:" + "t" * 129, "tag 'ttt"),
        ("app:v/1", "tag 'v/1'"),
        ("app@sha256:abc", "digest 'sha256:abc'"),
        (f"app@md5:{HEX}", "digest 'md5:"),
        (f"app@sha256:{HEX.upper()}", "lowercase hex"),
        (f"app:v1@{DIGEST}", "either a tag or a digest"),
        ("localhost:5000/app", "tag '5000/app'"),
    ],
)
def test_parse_invalid_reference(ref: str, complaint: str) -> None:
    with pytest.raises(InvalidImageReference, match=r"config\.image: ") as caught:
        parse_reference(ref)
    assert complaint in str(caught.value)
    assert isinstance(caught.value, InvalidArgument)
    assert caught.value.field == "config.image"
