"""An HTTP proxy in front of the tests' moto server that answers chosen AWS operations with a
fault, as AWS (or a load balancer in front of it) does now and then: an HTML 500 page, throttling,
a connection closed without an answer. Everything else is passed to moto as it came.

moto cannot fail one operation by itself, and botocore's Stubber would test a fake client, not
gpuctl's own HTTP calls: this is the real request path with a real bad answer. Loopback only."""

from __future__ import annotations

import http.client
import http.server
import re
import threading
import urllib.parse
from dataclasses import dataclass, field

HTML_500 = (b"<html><head><title>500 Internal Server Error</title></head><body><h1>Internal Server Error</h1>"
            b"<p>The server encountered an internal error.</p></body></html>")
THROTTLED = (b'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>RequestLimitExceeded</Code>'
             b"<Message>Request limit exceeded.</Message></Error></Errors><RequestID>x</RequestID></Response>")


@dataclass
class Fault:
    action: str  # the Query API's Action (EC2, IAM, ...), e.g. TerminateInstances
    region: str | None = None  # only requests signed for this region
    kind: str = "html-500"  # html-500 | throttled | dropped | garbage-200 (an HTML page with a 200)
    seen: list[str] = field(default_factory=list)  # the regions of the requests it answered


def relay(upstream: urllib.parse.SplitResult, handler: http.server.BaseHTTPRequestHandler, body: bytes | None
          ) -> tuple[int, list[tuple[str, str]], bytes]:
    """The request `handler` holds, sent on to `upstream` as it came: (status, headers, body)."""
    conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=60)
    try:
        conn.request(handler.command, handler.path, body=body,
                     headers={k: v for k, v in handler.headers.items() if k.lower() != "connection"})
        res = conn.getresponse()
        return res.status, res.getheaders(), res.read()
    finally:
        conn.close()


def send_head(handler: http.server.BaseHTTPRequestHandler, status: int, headers: list[tuple[str, str]],
              length: int) -> None:
    """An answer's status and headers as relayed (its own length; no hop-by-hop headers)."""
    handler.send_response(status)
    for k, v in headers:
        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
            handler.send_header(k, v)
    handler.send_header("Content-Length", str(length))
    handler.end_headers()


class FaultyAws:
    def __init__(self, upstream: str):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.faults: list[Fault] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet: pytest captures stderr
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy._fault(self.headers.get("Authorization", ""), body, self.path)
                if fault is not None:
                    return proxy._answer(self, fault)
                status, headers, data = relay(proxy.upstream, self, body)
                send_head(self, status, headers, len(data))
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def fail(self, action: str, region: str | None = None, kind: str = "html-500") -> Fault:
        fault = Fault(action, region, kind)
        self.faults.append(fault)
        return fault

    def _fault(self, auth: str, body: bytes, path: str) -> Fault | None:
        m = re.search(r"Credential=[^/]+/\d+/([^/]+)/", auth)
        region = m.group(1) if m else None
        query = urllib.parse.parse_qs(body.decode("latin-1")) | urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        action = (query.get("Action") or [""])[0]
        for fault in self.faults:
            if fault.action == action and fault.region in (None, region):
                fault.seen.append(region or "?")
                return fault
        return None

    @staticmethod
    def _answer(handler: http.server.BaseHTTPRequestHandler, fault: Fault) -> None:
        if fault.kind == "dropped":
            handler.close_connection = True
            handler.connection.close()
            return
        status, body, kind = {"html-500": (500, HTML_500, "text/html"), "garbage-200": (200, HTML_500, "text/html"),
                              "throttled": (400, THROTTLED, "text/xml")}[fault.kind]
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
