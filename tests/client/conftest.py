"""The SDK and CLI tests run against the same real fleet as the flaps tests."""

from tests.flaps.conftest import fleet

__all__ = ["fleet"]
