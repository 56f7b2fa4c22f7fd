"""Helpers the CLI's tests share (the fleet and `nonomad` itself are in conftest.py)."""

from __future__ import annotations

from tests.cli.conftest import Result


def one_line_error(result: Result, code: int, *fragments: str) -> None:
    """A failed command: the exit code, one line on stderr naming the problem, no traceback."""
    assert result.code == code, (result.out, result.err)
    assert result.err.count("\n") == 1, result.err
    assert result.err.startswith("nonomad"), result.err
    assert "Traceback" not in result.err
    for fragment in fragments:
        assert fragment in result.err, result.err
