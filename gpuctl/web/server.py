"""The dashboard's HTTP side (Starlette): the page, its data, its event stream, and its acts.

Reachable by this user only: it listens on 127.0.0.1; the page's shell and its script and style
(no data, nothing secret: they are the package's files) load without a token, everything else
needs it: as `Authorization: Bearer TOKEN`, which the page's script sends from the URL's
fragment (`#token=...`: never sent to a server, never in a Referer), and as `?token=` on the
event stream alone (EventSource sends no header). No cookie: a cookie for 127.0.0.1 goes to every
port of it (a forwarded TensorBoard's too). A Host header other than the loopback address it
listens on is refused (DNS rebinding); an act is a POST with the CSRF token the view gave and an
Origin of the page's own; no CORS header is ever sent; the Content-Security-Policy allows the
package's own script and style only, and the page sets text, never markup."""

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
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from gpuctl.model.dashboard import ActionResult
from gpuctl.web.poller import Poller

ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
PUBLIC = {"/", "/favicon.ico", *(f"/static/{name}" for name in ASSETS)}  # the shell: no data in it
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-store"}
EVENT_CHECK_S = 0.2  # how often an event stream compares the poller's version (in memory, no look)
KEEPALIVE_S = 15.0

# An act: (what it is asked for) -> the result the page shows. Runs in a worker thread.
Act = Callable[[str], ActionResult]
# What the page asks before an act: (act, target) -> the question, in the CLI's words.
Ask = Callable[[str, str], str]


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
        given = request.headers.get("authorization", "").removeprefix("Bearer ")
        if request.url.path == "/api/events":
            given = given or request.query_params.get("token", "")
        return hmac.compare_digest(given.encode(), self.token.encode())

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await self._answer(request, call_next)
        response.headers.update(HEADERS)
        return response

    async def _answer(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if request.headers.get("host", "") not in self.hosts:
            return PlainTextResponse("Not this host.", status_code=403)
        if request.url.path in PUBLIC and request.method == "GET":
            return await call_next(request)
        if not self._has_token(request):
            return PlainTextResponse("A token is needed: open the URL `gpuctl dashboard` printed.", status_code=401)
        if request.method == "POST":
            origin = request.headers.get("origin", "")
            sent = request.headers.get("x-csrf-token", "")
            if origin not in self.origins or not hmac.compare_digest(sent.encode(), self.csrf.encode()):
                return PlainTextResponse("Refused: not from the dashboard's own page.", status_code=403)
        return await call_next(request)


def make_app(poller: Poller, token: str, port: int, acts: dict[str, Act], ask: Ask) -> Starlette:
    """The dashboard's app; `acts` maps an action's name ("stop", "release") to its use case,
    `ask` words the question the page asks before it."""
    csrf = csrf_of(token).encode()

    async def page(request: Request) -> Response:
        return Response(asset("index.html"), media_type="text/html; charset=utf-8")

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
        return _json(b'{"version":%d,"looks":%d,"csrf":"%s","error":%s,"view":%s,"run":%s}' % (
            version, looks, csrf, said, body or b"null", detail))

    async def question(request: Request) -> Response:
        """What the page asks before an act (`down`'s own question names runs only on the instance)."""
        name, target = request.query_params.get("act", ""), request.query_params.get("target", "")
        if name not in acts or not target:
            return JSONResponse({"ok": False, "message": "no such act", "hint": None}, status_code=400)
        return JSONResponse({"question": await run_in_threadpool(ask, name, target)})

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
              Route("/api/question", question), Route("/api/events", events)]
    routes += [Route(f"/api/{name}", acting(name), methods=["POST"]) for name in acts]
    return Starlette(routes=routes, middleware=[Middleware(Guard, token=token, port=port)])
