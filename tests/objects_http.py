"""A small HTTP server that serves objects the way S3 serves a presigned GET: ETag header,
Range (206), If-Match (412 when the ETag differs), and chosen faults: 503 SlowDown a number of
times, or a body that stops half-way until the test lets it go on. moto cannot throttle, change
an object between two requests of one download, or hold a body half-sent; this is real HTTP with
those answers, for the fetch payload's tests. Loopback only."""

from __future__ import annotations

import hashlib
import http.server
import threading
import urllib.parse
from dataclasses import dataclass, field

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class Quiet(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1, no log lines (pytest captures stderr); `key()`: the path's object key."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def key(self, requests: list[tuple[str, dict[str, str]]]) -> str:
        """The request's key (path style: BUCKET/KEY), recorded with its headers in `requests`."""
        key = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path.lstrip("/"))
        requests.append((key, {k.lower(): v for k, v in self.headers.items()}))
        return key

    def held(self, body: bytes, after: int, release: threading.Event) -> None:
        """The first `after` bytes of the body, then nothing until `release` (a cut connection)."""
        self.wfile.write(body[:after])
        self.wfile.flush()
        release.wait(120)
        self.close_connection = True


def serve(handler: type[http.server.BaseHTTPRequestHandler]) -> http.server.ThreadingHTTPServer:
    """A threaded server on a free loopback port, serving until shut down."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return httpd


@dataclass
class Served:
    body: bytes
    etag: str = ""  # default: the MD5 of body, as S3 gives for a single-part upload
    slow_downs: int = 0  # answer 503 SlowDown this many times first
    forbidden: int = 0  # answer 403 AccessDenied this many times first (a role's policy not in force yet)
    hold_after: int | None = None  # send this many bytes, then wait for `release` (the test's cut)
    lie_etag: str | None = None  # the ETag header said, whatever the body is
    headers: dict[str, str] = field(default_factory=dict)  # more of S3's headers (x-amz-server-side-encryption)

    def __post_init__(self) -> None:
        self.etag = self.etag or hashlib.md5(self.body).hexdigest()


@dataclass
class Recording:
    """What both servers keep: each request's key and headers, the event a held body waits for."""

    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    httpd: http.server.ThreadingHTTPServer = field(init=False)

    def asked(self, key: str) -> list[dict[str, str]]:
        return [h for k, h in self.requests if k == key]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class ObjectServer(Recording):
    objects: dict[str, Served] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)  # each request's path and query, as sent

    def start(self) -> ObjectServer:
        server = self

        class Handler(Quiet):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                key = self.key(server.requests)
                server.paths.append(self.path)
                obj = server.objects.get(key)
                if obj is None:
                    return self._send(404, b"NoSuchKey")
                if obj.slow_downs > 0:
                    obj.slow_downs -= 1
                    return self._send(503, SLOW_DOWN)
                if obj.forbidden > 0:
                    obj.forbidden -= 1
                    return self._send(403, b"AccessDenied")
                match = (self.headers.get("If-Match") or "").strip('"')
                if match and match != obj.etag:
                    return self._send(412, b"PreconditionFailed")
                body, status, extra = obj.body, 200, {}
                rng = self.headers.get("Range")
                if rng:
                    start = int(rng.split("=")[1].split("-")[0])
                    if start >= len(body):
                        return self._send(416, b"InvalidRange")
                    extra["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
                    body, status = body[start:], 206
                self.send_response(status)
                self.send_header("ETag", f'"{obj.lie_etag or obj.etag}"')
                self.send_header("Content-Length", str(len(body)))
                for k, v in {**extra, **obj.headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                if obj.hold_after is not None and status == 200:
                    return self.held(body, obj.hold_after, server.release)
                self.wfile.write(body)

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = serve(Handler)
        return self

    def url(self, key: str) -> str:
        port = self.httpd.server_address[1]
        return f"http://127.0.0.1:{port}/{urllib.parse.quote(key)}?X-Amz-Signature=made-up"


@dataclass
class HoldingProxy(Recording):
    """In front of the tests' moto S3: passes every GET on, except that the body of `hold` (a key,
    path style: BUCKET/KEY) stops after `hold_after` bytes until `release` is set: a fetch cut
    half-way through one object, on purpose. Records each request's key and headers."""

    upstream: str = ""
    hold: str = ""
    hold_after: int = 0

    def start(self) -> HoldingProxy:
        from tests.faulty_aws import relay, send_head

        proxy = self
        up = urllib.parse.urlsplit(self.upstream)

        class Handler(Quiet):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                key = self.key(proxy.requests)
                status, headers, body = relay(up, self, None)
                send_head(self, status, headers, len(body))
                if key == proxy.hold and status == 200 and not proxy.release.is_set():
                    return self.held(body, proxy.hold_after, proxy.release)
                self.wfile.write(body)

        self.httpd = serve(Handler)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"
