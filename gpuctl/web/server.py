"""The dashboard's HTTP side (Starlette): the page, its data, its event stream, and its two acts.

Reachable by this user only: it listens on 127.0.0.1; every request needs the token (from the URL
once, then an HttpOnly SameSite=Strict cookie); a Host header other than the loopback address it
listens on is refused (DNS rebinding); an act is a POST with the page's CSRF token from the same
origin; no CORS header is ever sent; the Content-Security-Policy allows the package's own script
and style only, so nothing the instance wrote can run even if it reached the page's markup (the
page sets text, never markup)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from importlib import resources
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from gpuctl.model.dashboard import ActionResult
from gpuctl.web.poller import Poller

COOKIE = "gpuctl_dashboard"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
EVENT_CHECK_S = 0.2  # how often an event stream compares the poller's version (in memory, no look)
KEEPALIVE_S = 15.0

# An act: (what it is asked for) -> the result the page shows. Runs in a worker thread.
Act = Callable[[str], ActionResult]


def csrf_of(token: str) -> str:
    """The page's CSRF token: derived from the secret, so nothing more is kept."""
    return hmac.new(token.encode(), b"gpuctl-dashboard-csrf", hashlib.sha256).hexdigest()


def asset(name: str) -> bytes:
    return resources.files("gpuctl.web").joinpath("assets").joinpath(name).read_bytes()


class Guard(BaseHTTPMiddleware):
    """Host, token and (for a POST) origin and CSRF checks before any route."""

    def __init__(self, app: Any, token: str, port: int):
        super().__init__(app)
        self.token, self.csrf = token, csrf_of(token)
        self.hosts = {f"127.0.0.1:{port}", f"localhost:{port}"}
        self.origins = {f"http://{h}" for h in self.hosts}

    def _has_token(self, request: Request) -> bool:
        given = request.cookies.get(COOKIE) or request.query_params.get("token") or ""
        return hmac.compare_digest(given.encode(), self.token.encode())

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if request.headers.get("host", "") not in self.hosts:
            return PlainTextResponse("Not this host.", status_code=403)
        if not self._has_token(request):
            return PlainTextResponse("A token is needed: open the URL `gpuctl dashboard` printed.", status_code=401)
        if request.method == "POST":
            origin = request.headers.get("origin", "")
            sent = request.headers.get("x-csrf-token", "")
            if origin not in self.origins or not hmac.compare_digest(sent.encode(), self.csrf.encode()):
                return PlainTextResponse("Refused: not from the dashboard's own page.", status_code=403)
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Cache-Control"] = "no-store"
        return response


def make_app(poller: Poller, token: str, port: int, acts: dict[str, Act]) -> Starlette:
    """The dashboard's app; `acts` maps an action's name ("stop", "release") to its use case."""
    csrf = csrf_of(token)

    async def page(request: Request) -> Response:
        if "token" in request.query_params:  # from the printed URL: into a cookie, out of the address bar
            response: Response = RedirectResponse("/", status_code=303)
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/")
            return response
        html = asset("index.html").decode().replace("{{csrf}}", csrf)
        return Response(html, media_type="text/html; charset=utf-8")

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return PlainTextResponse("No such file.", status_code=404)
        return Response(asset(name), media_type=ASSETS[name])

    def _json(body: bytes) -> Response:
        return Response(body, media_type="application/json")

    async def view(request: Request) -> Response:
        """The view, the error of the last look, and (?run=ID) that run's detail, all of one look;
        without ?run=, the detail of the newest running run (else of the newest run)."""
        run_id = request.query_params.get("run")
        with poller.lock:
            body, error, version, looks = poller.view_json, poller.error, poller.version, poller.looks
            detail = poller.details.get(run_id if run_id is not None else poller.default_run, b"null")
        said = ActionResult(ok=False, message=error[0], hint=error[1]).model_dump_json().encode() if error else b"null"
        return _json(b'{"version":%d,"looks":%d,"error":%s,"view":%s,"run":%s}' % (
            version, looks, said, body or b"null", detail))

    async def events(request: Request) -> Response:
        async def stream() -> AsyncIterator[bytes]:
            seen, quiet = -1, 0.0
            while not await request.is_disconnected():
                now = poller.version
                if now != seen:
                    seen, quiet = now, 0.0
                    yield b"event: changed\ndata: %d\n\n" % now
                elif quiet >= KEEPALIVE_S:
                    quiet = 0.0
                    yield b": still here\n\n"
                await asyncio.sleep(EVENT_CHECK_S)
                quiet += EVENT_CHECK_S
        return StreamingResponse(stream(), media_type="text/event-stream")

    def acting(name: str) -> Callable[[Request], Awaitable[Response]]:
        async def act(request: Request) -> Response:
            try:
                target = str((await request.json()).get("target", ""))
            except (ValueError, AttributeError):
                target = ""
            if not target:
                return JSONResponse({"ok": False, "message": f"{name}: nothing named", "hint": None}, status_code=400)
            result = await run_in_threadpool(acts[name], target)
            await run_in_threadpool(poller.poke)
            return _json(result.model_dump_json().encode())
        return act

    async def no_icon(request: Request) -> Response:
        return Response(status_code=204)  # browsers ask for one; a 404 would be an error in the console

    routes = [Route("/", page), Route("/favicon.ico", no_icon), Route("/static/{name}", static), Route("/api/view", view),
              Route("/api/events", events)]
    routes += [Route(f"/api/{name}", acting(name), methods=["POST"]) for name in acts]
    return Starlette(routes=routes, middleware=[Middleware(Guard, token=token, port=port)])
