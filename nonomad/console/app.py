"""The console's routes: pages, their JSON twins, their live streams, the login, the static
files, all behind the front door (`guard`: Host, cross-site and session checks, and the
security headers on every answer).

Every page answers HTML, or its data as JSON when the request prefers it
(`Accept: application/json`): the JSON is what the HTML is rendered from. Each page's live
parts come from `/live/...` as server-sent events (nonomad.console.streams). A page reads the
cluster as its session's token may (`Pages.scoped`). Bad input is a 400 naming what is wrong,
an app or machine the token may not read a 403 (whether it exists or not), an unknown one a
404, a part of the cluster that does not answer a 503, too many streams open for one session
a 429: each with its reason, as JSON or as a page.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from nonomad.client import ApiError, NotFound, PermissionDenied, Unauthenticated
from nonomad.console import model, render, streams
from nonomad.console.guard import Door, Guard, session_of
from nonomad.console.live import Live
from nonomad.console.login import Login
from nonomad.console.pages import Hidden, Pages
from nonomad.console.sessions import Session
from runtime.errors import InvalidArgument
from runtime.validate import check_name

__all__ = ["LOG_STREAMS", "build"]

SSE_HEADERS = {"X-Accel-Buffering": "no"}
LOG_STREAMS = 64
"""Machine log streams open at once, over every session (each is a follow call at flaps)."""


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
        self.log_streams = 0

    def view(self, request: Request) -> Pages:
        """The pages as the request's session sees them."""
        session = session_of(request)
        return self.pages.scoped(session.scope, session.flaps)

    def respond(
        self, request: Request, template: str, data: model.Data, **context: object
    ) -> Response:
        if render.wants_json(request):
            return JSONResponse(data)
        session = session_of(request)
        viewer = {**session.scope.describe(), "csrf": session.csrf}
        return HTMLResponse(render.page(template, data=data, viewer=viewer, **context))

    def feed(self, pages: Pages, app: str = "") -> dict[str, object]:
        events = pages.events(app=app)
        return {"feed": events["events"], "seq": events["last_seq"]}

    async def fleet(self, request: Request) -> Response:
        pages = self.view(request)
        data = pages.fleet()
        return self.respond(
            request, "fleet.html", data, nav="fleet", live_url="/live/fleet", **self.feed(pages)
        )

    async def apps(self, request: Request) -> Response:
        return self.respond(request, "apps.html", self.view(request).fleet(), nav="apps")

    async def app(self, request: Request) -> Response:
        name = _name("app", request.path_params["app"])
        destroyed = request.query_params.get("destroyed") in ("1", "true", "yes")
        page = _page(request)
        pages = self.view(request)
        data = await pages.app(name, destroyed=destroyed, page=page)
        if not data["machines"] and name not in pages.replica.apps():
            raise HTTPException(404, f"no machine of app {name} is known")
        if page > data["page"]["pages"]:
            raise HTTPException(404, f"page: app {name} has {data['page']['pages']} pages")
        return self.respond(
            request,
            "app.html",
            data,
            nav="apps",
            live_url=f"/live/apps/{name}?page={page}",
            **self.feed(pages, name),
        )

    async def machine(self, request: Request) -> Response:
        machine_id = _name("machine_id", request.path_params["machine_id"])
        data = await self.view(request).machine(machine_id)
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
        pages = self.view(request)
        if app:
            _name("app", app)
            pages.check_app(app)
        live = f"/live/events?app={app}" if app else "/live/events"
        data = pages.events(app=app)
        return self.respond(request, "events.html", data, nav="events", live_url=live)

    # -- live --------------------------------------------------------------------------------

    def _open(self, session: Session, body: AsyncIterator[str]) -> Response:
        """A stream of the session's, counted against its limit; it ends with the console or
        the session."""
        if session.streams >= session.stream_cap:
            raise HTTPException(429, f"this session has {session.stream_cap} live streams open")
        session.streams += 1

        async def counted() -> AsyncIterator[str]:
            try:
                async for chunk in streams.until((self.closing, session.ended), body):
                    yield chunk
            finally:
                session.streams -= 1

        return StreamingResponse(counted(), media_type="text/event-stream", headers=SSE_HEADERS)

    def _stream(self, request: Request, view: streams.LiveView, pages: Pages) -> Response:
        session = session_of(request)
        body = streams.serve(view, self.live, _after(request), pages.scope)
        return self._open(session, body)

    async def live_fleet(self, request: Request) -> Response:
        pages = self.view(request)
        return self._stream(request, streams.FleetView(pages), pages)

    async def live_app(self, request: Request) -> Response:
        name = _name("app", request.path_params["app"])
        pages = self.view(request)
        pages.check_app(name)
        return self._stream(request, streams.AppView(pages, name, _page(request)), pages)

    async def live_machine(self, request: Request) -> Response:
        machine_id = _name("machine_id", request.path_params["machine_id"])
        pages = self.view(request)
        await self._readable(pages, machine_id)
        return self._stream(request, streams.MachineView(pages, machine_id), pages)

    async def live_events(self, request: Request) -> Response:
        app = request.query_params.get("app", "")
        pages = self.view(request)
        if app:
            _name("app", app)
            pages.check_app(app)
        return self._stream(request, streams.EventsView(app), pages)

    async def _readable(self, pages: Pages, machine_id: str) -> None:
        """A 403 or 404 now, not a broken stream: the replica's row, then flaps (with the
        session's token) for the machine."""
        known = pages.replica.machine(machine_id)
        if known is not None:
            pages.check_machine(known.app, machine_id)
        machine = await pages.flaps.get_machine(machine_id)
        pages.check_machine(machine.app, machine_id)

    async def live_logs(self, request: Request) -> Response:
        machine_id = _name("machine_id", request.path_params["machine_id"])
        pages = self.view(request)
        await self._readable(pages, machine_id)
        if self.log_streams >= LOG_STREAMS:
            raise HTTPException(429, f"the console has {LOG_STREAMS} log streams open")
        self.log_streams += 1
        session = session_of(request)

        async def body() -> AsyncIterator[str]:
            try:
                async for chunk in streams.logs(pages.flaps, machine_id, (session.ended,)):
                    yield chunk
            finally:
                self.log_streams -= 1

        try:
            return self._open(session, body())
        except HTTPException:
            self.log_streams -= 1
            raise


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return render.error_response(request, exc.status_code, exc.detail)


async def _hidden(request: Request, exc: Exception) -> Response:
    return render.error_response(request, 403, str(exc))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if isinstance(exc, NotFound):
        return render.error_response(request, 404, exc.message)
    if isinstance(exc, PermissionDenied):
        return render.error_response(request, 403, f"flaps: {exc.message}")
    if isinstance(exc, Unauthenticated):
        return render.error_response(request, 401, f"flaps: {exc.message}")
    return render.error_response(request, 503, f"flaps: {exc.code.name}: {exc.message}")


def build(pages: Pages, live: Live, closing: asyncio.Event, door: Door) -> Guard:
    """The console's ASGI app, behind its front door."""
    c = Console(pages, live, closing)
    login = Login(door)
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
    routes += [
        Route("/login", login.form, methods=["GET"]),
        Route("/login", login.submit, methods=["POST"]),
        Route("/login/codes", login.issue_code, methods=["POST"]),
        Route("/logout", login.logout, methods=["POST"]),
        Mount("/static", StaticFiles(directory=render.STATIC), name="static"),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, ApiError: _api_error, Hidden: _hidden},
    )
    return Guard(app, door)
