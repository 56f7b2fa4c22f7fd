"""HTML from page data: the Jinja templates under `templates/`, autoescaped, and single
fragments of them (`parts.html` macros) for live updates; server-sent event framing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2

TEMPLATES = Path(__file__).parent / "templates"
STATIC = Path(__file__).parent / "static"


def _filesize(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    auto_reload=False,
)
ENV.filters["filesize"] = _filesize


def page(template: str, **context: Any) -> str:
    """A whole page."""
    context.setdefault("live_url", "")
    context.setdefault("logs_url", "")
    context.setdefault("nav", "")
    return ENV.get_template(template).render(**context)


def part(name: str, *args: Any) -> str:
    """One fragment: the `parts.html` macro `name` called with `args`."""
    macro = getattr(ENV.get_template("parts.html").module, name)
    return str(macro(*args))


def sse(event: str, data: Any, event_id: int | None = None) -> str:
    """One server-sent event carrying `data` as JSON (so it is one line)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


KEEPALIVE = ": keep-alive\n\n"
