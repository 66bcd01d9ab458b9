"""The token check in front of TensorBoard (payloads/gpuctl_tensorboard.py), over a real loopback
HTTP server (wsgiref) with a stand-in app: TensorBoard itself is slow to start, and the tests that
run it (integration/test_secrets_tensorboard.py, test_ssh.py) try it as another user."""

from __future__ import annotations

import http.client
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest

from gpuctl.payloads import gpuctl_tensorboard as tb

TOKEN = "t0ken-abcdefghijklmnopqrstuvwxyz"


class Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"the page " + environ.get("QUERY_STRING", "").encode()]

    srv = make_server("127.0.0.1", 0, tb.guard(app, TOKEN), handler_class=Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_port
    srv.shutdown()


def get(port, path, cookie=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", path, headers={"Cookie": cookie} if cookie else {})
    resp = conn.getresponse()
    return resp.status, dict(resp.getheaders()), resp.read()


def test_only_the_token_or_its_cookie_gets_in(server):
    name = tb.cookie_name(TOKEN)
    for path, cookie in [("/", None), ("/?token=wrong", None), ("/?token=", None), ("/data/runs", f"{name}=wrong"),
                         ("/", f"other={TOKEN}"), ("/", 'x="\\'), (f"/?token={TOKEN[:-1]}", None)]:
        status, _, body = get(server, path, cookie)
        assert status == 403 and b"owner only" in body and b"the page" not in body, (path, cookie)
    status, headers, _ = get(server, f"/x/y?a=1&token={TOKEN}&b=2")
    assert status == 303 and headers["Location"] == "/x/y?a=1&b=2"  # the token leaves the address bar
    set_cookie = headers["Set-Cookie"]
    assert set_cookie.startswith(f"{name}={TOKEN};") and "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
    status, _, body = get(server, "/x/y?a=1", f"{name}={TOKEN}")
    assert status == 200 and body == b"the page a=1"


def test_a_token_file_that_is_not_one_is_refused(tmp_path):
    bad = tmp_path / "token"
    bad.write_text("short")
    with pytest.raises(SystemExit, match="no usable token"):
        tb.read_token(str(bad))
    bad.write_text(TOKEN + "\n")
    assert tb.read_token(str(bad)) == TOKEN
