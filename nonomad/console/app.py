"""The console's routes: pages, their JSON twins, their live streams, the static files.

Every page answers HTML, or its data as JSON when the request prefers it
(`Accept: application/json`): the JSON is what the HTML is rendered from. Each page's live
parts come from `/live/...` as server-sent events (nonomad.console.streams). Bad input is a
400 naming what is wrong, an unknown app or machine a 404, a part of the cluster that does not
answer a 503: each with its reason, as JSON or as a page.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from nonomad.client import ApiError, NotFound
from nonomad.console import model, render, streams
from nonomad.console.live import Live
from nonomad.console.pages import Pages
from runtime.errors import InvalidArgument
from runtime.validate import check_name

__all__ = ["build"]

NO_STORE = {"Cache-Control": "no-store"}
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def wants_json(request: Request) -> bool:
    """Whether the client prefers JSON to HTML (by the Accept header's order and weights)."""
    best: dict[str, float] = {}
    for position, part in enumerate(request.headers.get("accept", "").split(",")):
        kind, *params = (p.strip() for p in part.split(";"))
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


def _name(kind: str, value: str) -> str:
    try:
        check_name(kind, value)
    except InvalidArgument as err:
        raise HTTPException(400, str(err)) from None
    return value


def _after(request: Request) -> int:
    """The feed item a stream starts after: the browser's Last-Event-ID on a reconnect, else
    the page's `after`."""
    raw = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    if not raw.isdigit():
        raise HTTPException(400, "after: must be a feed item number")
    return int(raw)


def _page(request: Request) -> int:
    raw = request.query_params.get("page", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise HTTPException(400, "page: must be a page number, 1 or more")
    return int(raw)


class Console:
    """The handlers, around the page data and the live hub."""

    def __init__(self, pages: Pages, live: Live, closing: asyncio.Event) -> None:
        self.pages = pages
        self.live = live
        self.closing = closing

    def respond(
        self, request: Request, template: str, data: model.Data, **context: object
    ) -> Response:
        if wants_json(request):
            return JSONResponse(data, headers=NO_STORE)
        html = render.page(template, data=data, **context)
        return HTMLResponse(html, headers=NO_STORE)

    def feed(self, app: str = "") -> dict[str, object]:
        events = self.pages.events(app=app)
        return {"feed": events["events"], "seq": events["last_seq"]}

    async def fleet(self, request: Request) -> Response:
        data = self.pages.fleet()
        return self.respond(
            request, "fleet.html", data, nav="fleet", live_url="/live/fleet", **self.feed()
        )

    async def apps(self, request: Request) -> Response:
        return self.respond(request, "apps.html", self.pages.fleet(), nav="apps")

    async def app(self, request: Request) -> Response:
        name = _name("app", request.path_params["app"])
        destroyed = request.query_params.get("destroyed") in ("1", "true", "yes")
        page = _page(request)
        data = await self.pages.app(name, destroyed=destroyed, page=page)
        if not data["machines"] and name not in self.pages.replica.apps():
            raise HTTPException(404, f"no machine of app {name} is known")
        if page > data["page"]["pages"]:
            raise HTTPException(404, f"page: app {name} has {data['page']['pages']} pages")
        return self.respond(
            request,
            "app.html",
            data,
            nav="apps",
            live_url=f"/live/apps/{name}?page={page}",
            **self.feed(name),
        )

    async def machine(self, request: Request) -> Response:
        machine_id = _name("machine_id", request.path_params["machine_id"])
        data = await self.pages.machine(machine_id)
        return self.respond(
            request,
            "machine.html",
            data,
            nav="apps",
            live_url=f"/live/machines/{machine_id}",
            logs_url=f"/live/machines/{machine_id}/logs",
            config_text=json.dumps(data["config"], indent=2, sort_keys=True),
        )

    async def events(self, request: Request) -> Response:
        app = request.query_params.get("app", "")
        if app:
            _name("app", app)
        live = f"/live/events?app={app}" if app else "/live/events"
        data = self.pages.events(app=app)
        return self.respond(request, "events.html", data, nav="events", live_url=live)

    # -- live --------------------------------------------------------------------------------

    def _stream(self, request: Request, view: streams.LiveView) -> Response:
        body = streams.serve(view, self.live, _after(request))
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)

    async def live_fleet(self, request: Request) -> Response:
        return self._stream(request, streams.FleetView(self.pages))

    async def live_app(self, request: Request) -> Response:
        name = _name("app", request.path_params["app"])
        return self._stream(request, streams.AppView(self.pages, name, _page(request)))

    async def live_machine(self, request: Request) -> Response:
        machine_id = _name("machine_id", request.path_params["machine_id"])
        return self._stream(request, streams.MachineView(self.pages, machine_id))

    async def live_events(self, request: Request) -> Response:
        app = request.query_params.get("app", "")
        if app:
            _name("app", app)
        return self._stream(request, streams.EventsView(app))

    async def live_logs(self, request: Request) -> Response:
        machine_id = _name("machine_id", request.path_params["machine_id"])
        await self.pages.flaps.get_machine(machine_id)  # a 404 now, not a broken stream
        body = streams.logs(self.pages.flaps, machine_id, self.closing)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


def _error_response(request: Request, status: int, reason: str) -> Response:
    if wants_json(request) or request.url.path.startswith("/live/"):
        return JSONResponse({"status": status, "reason": reason}, status_code=status)
    html = render.page("error.html", status=status, reason=reason)
    return HTMLResponse(html, status_code=status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error_response(request, exc.status_code, exc.detail)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if isinstance(exc, NotFound):
        return _error_response(request, 404, exc.message)
    return _error_response(request, 503, f"flaps: {exc.code.name}: {exc.message}")


def build(pages: Pages, live: Live, closing: asyncio.Event) -> Starlette:
    """The console's ASGI app."""
    c = Console(pages, live, closing)
    pages_and_streams: list[tuple[str, Callable[[Request], Awaitable[Response]]]] = [
        ("/", c.fleet),
        ("/apps", c.apps),
        ("/apps/{app}", c.app),
        ("/machines/{machine_id}", c.machine),
        ("/events", c.events),
        ("/live/fleet", c.live_fleet),
        ("/live/apps/{app}", c.live_app),
        ("/live/machines/{machine_id}", c.live_machine),
        ("/live/machines/{machine_id}/logs", c.live_logs),
        ("/live/events", c.live_events),
    ]
    routes: list[Route | Mount] = [Route(path, handler) for path, handler in pages_and_streams]
    routes.append(Mount("/static", StaticFiles(directory=render.STATIC), name="static"))
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, ApiError: _api_error},
    )
