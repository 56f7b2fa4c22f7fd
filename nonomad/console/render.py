"""HTML from page data: the Jinja templates under `templates/`, autoescaped, and single
fragments of them (`parts.html` macros) for live updates; server-sent event framing; a refusal
as JSON or as a page, whichever the client prefers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

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
    context.setdefault("viewer", None)
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


def wants_json(request: Request) -> bool:
    """Whether the client prefers JSON to HTML (by the Accept header's order and weights)."""
    best: dict[str, float] = {}
    for position, item in enumerate(request.headers.get("accept", "").split(",")):
        kind, *params = (p.strip() for p in item.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        # Earlier types win ties: a browser lists text/html first.
        best[kind.lower()] = max(best.get(kind.lower(), -1.0), q - position * 1e-6)
    json_q = best.get("application/json", -1.0)
    return json_q > 0 and json_q > best.get("text/html", -1.0)


def error_response(request: Request, status: int, reason: str) -> Response:
    """The refusal as JSON (to a client that prefers it, and on a stream) or as a page."""
    if wants_json(request) or request.url.path.startswith("/live/"):
        return JSONResponse({"status": status, "reason": reason}, status_code=status)
    html = page("error.html", status=status, reason=reason)
    return HTMLResponse(html, status_code=status)
