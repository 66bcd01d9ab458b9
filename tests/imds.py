"""A fake EC2 instance metadata service (IMDSv2) over real HTTP, for the spot-interruption tests.

As on EC2: a session token from `PUT /latest/api/token` (with X-aws-ec2-metadata-token-ttl-seconds)
is required on every GET (401 without it, as with `HttpTokens: required`); `spot/instance-action`
and `events/recommendations/rebalance` answer 404 until the test triggers them; the instance
profile's credentials are served under `iam/security-credentials/ROLE` (what boto3 on an instance
reads). It listens on every address so that the sshd test hosts reach it through their gateway
(http://GATEWAY:PORT), as an instance reaches 169.254.169.254.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"


def _iso(at: dt.datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeImds:
    def __init__(self) -> None:
        self.tokens: set[str] = set()
        self.paths: dict[str, str] = {}
        self.only: dict[str, str] = {}  # path -> the one client address that sees it (a notice for one instance)
        self.requests: list[tuple[str, str, bool]] = []  # (method, path, with a valid token)
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("0.0.0.0", 0), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FakeImds:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def url(self, host=None) -> str:
        """The endpoint as every test host (tests/sshd.py services_ip) or this machine reaches it."""
        return f"http://{host.services_ip if host is not None else '127.0.0.1'}:{self.port}"

    # --- what the test makes happen -----------------------------------------------------------

    def reset(self) -> None:
        with self.lock:
            self.paths.clear()
            self.only.clear()
            self.requests.clear()
            self.tokens.clear()

    def interrupt(self, host=None, action: str = "terminate", in_s: float = 120) -> None:
        """The two-minute warning: spot/instance-action appears, to `host` alone if given (each
        instance has its own IMDS; here the hosts share one, told apart by their address)."""
        at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=in_s)
        self._put("/latest/meta-data/spot/instance-action", json.dumps({"action": action, "time": _iso(at)}), host)

    def rebalance(self, host=None) -> None:
        """A rebalance recommendation: an elevated risk of interruption, no deadline."""
        self._put("/latest/meta-data/events/recommendations/rebalance",
                  json.dumps({"noticeTime": _iso(dt.datetime.now(dt.timezone.utc))}), host)

    def _put(self, path: str, body: str, host=None) -> None:
        with self.lock:
            self.paths[path] = body
            if host is not None:
                self.only[path] = host.ip

    def role(self, name: str, access_key: str = "testing", secret_key: str = "testing") -> None:
        """An instance profile: its role's temporary credentials, as EC2 serves them."""
        expires = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=6)
        with self.lock:
            self.paths["/latest/meta-data/iam/security-credentials/"] = name
            self.paths[f"/latest/meta-data/iam/security-credentials/{name}"] = json.dumps({
                "Code": "Success", "LastUpdated": _iso(dt.datetime.now(dt.timezone.utc)), "Type": "AWS-HMAC",
                "AccessKeyId": access_key, "SecretAccessKey": secret_key, "Token": "fake-session-token",
                "Expiration": _iso(expires)})

    def reached_by(self, hosts) -> None:
        """Each host reaches this IMDS now, at its lab's services address: else the test stops
        here, saying what the host saw, instead of a spot test timing out on a notice or
        credentials it never got (a host whose routes a link-down test took: sshd.routes())."""
        import subprocess

        for host in hosts:
            ask = (f"python3 -c \"import urllib.request as u; print(u.urlopen(u.Request('{self.url(host)}"
                   f"/latest/api/token', method='PUT', headers={{'{TOKEN_TTL_HEADER}': '60'}}), timeout=5).status)\"")
            seen = host.run(ask)
            assert seen.stdout.strip() == "200", (
                f"host {host.ip} does not reach the fake IMDS at {self.url(host)}: {seen.stderr.strip()[-300:]}; "
                f"its routes: {host.run('ip route').stdout.strip()}; here: "
                f"{subprocess.run(['ip', '-4', 'addr', 'show', 'lo'], capture_output=True, text=True).stdout.strip()}")

    def gets(self, path: str) -> list[bool]:
        """For each GET of `path` so far: whether it carried a valid token."""
        with self.lock:
            return [ok for method, p, ok in self.requests if method == "GET" and p == path]

    # --- the server ------------------------------------------------------------------------------

    def _handler(self):
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                ok = self.path == "/latest/api/token" and (self.headers.get(TOKEN_TTL_HEADER) or "").isdigit()
                with imds.lock:
                    imds.requests.append(("PUT", self.path, ok))
                    token = secrets.token_urlsafe(24) if ok else ""
                    if ok:
                        imds.tokens.add(token)
                self._send(200, token) if ok else self._send(400, "a token TTL header is required")

            def do_GET(self) -> None:
                with imds.lock:
                    ok = self.headers.get(TOKEN_HEADER) in imds.tokens
                    imds.requests.append(("GET", self.path, ok))
                    body = imds.paths.get(self.path)
                    if imds.only.get(self.path, self.client_address[0]) != self.client_address[0]:
                        body = None
                if not ok:
                    self._send(401)
                elif body is None:
                    self._send(404, "Not Found")
                else:
                    self._send(200, body)

        return Handler


@pytest.fixture(scope="session")
def imds_server():
    server = FakeImds().start()
    yield server
    server.stop()


@pytest.fixture
def imds(imds_server):
    """The fake IMDSv2, with nothing pending."""
    imds_server.reset()
    yield imds_server
    imds_server.reset()
