"""Deploy tests run against the same real fleet as the flaps and SDK tests."""

from tests.flaps.conftest import fleet

__all__ = ["fleet"]
