"""Issue 39: `gpuctl dashboard` as a process, over HTTP on loopback (httpx; the browser's view is
tests/e2e/test_dashboard_browser.py): the token, the Host check, the CSRF and origin checks, the
event stream, one poller for many clients, a second dashboard, a port in use, the runtime file.

Bad inputs tried: no token, a wrong token, the token of another dashboard, a Host header of
another name (DNS rebinding), a POST without CSRF token, with it from another origin, with no
origin, an act naming nothing, an unknown run, `--port` in use, `--port 70000`, `--interval 0`."""

from __future__ import annotations

import json
import socket
import stat

import httpx

from gpuctl.web.runtime import OPEN_FILE, RUNTIME_FILE
from gpuctl.web.server import csrf_of
from tests.conftest import QUICK_TRAIN
from tests.web import dashboard, wait_for


def _client(d, token: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=d.base, headers={"Authorization": f"Bearer {token}"} if token else None, timeout=30)


def test_every_request_for_data_needs_the_token_and_the_loopback_host(isolated):
    with dashboard(isolated) as d:
        assert d.url.startswith("http://127.0.0.1:") and "#token=" in d.url  # a fragment: never sent
        for path in ("/api/view", "/api/view?run=x", "/api/events", "/api/question?act=stop&target=x"):
            assert httpx.get(d.base + path, timeout=30).status_code == 401, path
            wrong = httpx.get(d.base + path, headers={"Authorization": "Bearer wrong"}, timeout=30)
            assert wrong.status_code == 401 and wrong.headers["x-content-type-options"] == "nosniff", path
        assert httpx.get(d.base + f"/api/view?token={d.token}", timeout=30).status_code == 401  # a header, not a query
        assert httpx.post(d.base + "/api/stop", json={"target": "x"}, timeout=30).status_code == 401
        # The shell (page, script, style) holds no data and nothing secret: it loads without the token.
        page = httpx.get(d.base + "/", timeout=30)
        assert page.status_code == 200 and d.token not in page.text and "set-cookie" not in page.headers
        assert "script-src 'self'" in page.headers["content-security-policy"]
        with _client(d, d.token) as c:
            answer = c.get("/api/view")
            assert "access-control-allow-origin" not in {k.lower() for k in answer.headers}
            view = answer.json()
            assert view["view"]["clusters"] == [] and view["error"] is None and view["csrf"] == csrf_of(d.token)
            # DNS rebinding: a name that resolves here is still not this host.
            for host in (f"evil.example:{d.port}", f"LOCALHOST:{d.port}", f"[::1]:{d.port}"):
                assert c.get("/api/view", headers={"Host": host}).status_code == 403, host
            # The event stream takes the token as a query (EventSource sends no header).
            with httpx.stream("GET", d.base + f"/api/events?token={d.token}", timeout=30) as events:
                assert events.status_code == 200 and next(events.iter_lines()) == "event: changed"
        with _client(d, "x" + d.token) as c:
            assert c.get("/api/view").status_code == 401


def test_acts_need_the_pages_csrf_token_from_the_same_origin(isolated, gpuctl, make_project):
    gpuctl("up", "--name", "lab")
    run = json.loads(gpuctl("train", make_project("p", {"train.py": "import time\ntime.sleep(600)\n"}),
                            "--json").stdout)["run"]["run_id"]
    with dashboard(isolated) as d, _client(d, d.token) as c:
        origin = {"Origin": d.base}
        csrf = {"X-CSRF-Token": csrf_of(d.token)}
        for headers in ({}, origin, csrf, {"Origin": "http://evil.example", **csrf},
                        {"Origin": "null", **csrf}, {**origin, "X-CSRF-Token": csrf_of("other")}):
            assert c.post("/api/stop", json={"target": run}, headers=headers).status_code == 403, headers
        assert json.loads(gpuctl("status", run, "--json").stdout)["runs"][0]["state"] == "running"
        nothing = c.post("/api/stop", json={}, headers={**origin, **csrf})
        assert nothing.status_code == 400 and "nothing named" in nothing.json()["message"]
        unknown = c.post("/api/stop", json={"target": "nope"}, headers={**origin, **csrf}).json()
        assert unknown["ok"] is False and "no run named 'nope'" in unknown["message"] and unknown["hint"]
        done = c.post("/api/stop", json={"target": run}, headers={**origin, **csrf}).json()
        assert done["ok"] is True and f"Stopped {run}" in done["message"], done
        assert json.loads(gpuctl("status", run, "--json").stdout)["runs"][0]["state"] == "stopped"
        assert c.get("/api/question", params={"act": "stop", "target": run}).json()["question"] == (
            f"Stop run {run}? The cluster stays up.")
        # The act's look is in the view by the time it answers.
        shown = {r["status"]["run_id"]: r["status"]["state"] for r in c.get("/api/view").json()["view"]["runs"]}
        assert shown[run] == "stopped"


def test_release_asks_downs_own_question_then_releases(isolated, gpuctl, make_project):
    gpuctl("up", "--name", "lab")
    gpuctl("train", make_project("p", {"train.py": "import time\ntime.sleep(600)\n"}))
    with dashboard(isolated) as d, _client(d, d.token) as c:
        asked = c.get("/api/question", params={"act": "release", "target": "lab"}).json()["question"]
        assert asked.startswith("Release cluster 'lab' and stop its jobs") and asked.endswith("?")
        assert c.get("/api/question", params={"act": "rm", "target": "lab"}).status_code == 400
        headers = {"Origin": d.base, "X-CSRF-Token": csrf_of(d.token)}
        done = c.post("/api/release", json={"target": "lab"}, headers=headers).json()
        assert done["ok"] is True and done["message"].startswith("Cluster 'lab' is down: released"), done
        assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "down"
        again = c.post("/api/release", json={"target": "lab"}, headers=headers).json()
        assert again["ok"] is True and "already down" in again["message"]
        shown = c.get("/api/view").json()["view"]["clusters"]
        assert [(x["name"], x["state"]) for x in shown] == [("lab", "down")]


def test_the_browser_is_given_a_private_file_not_the_token(isolated):
    from gpuctl.web.runtime import opener

    isolated.mkdir(parents=True)
    address = "http://127.0.0.1:1234/#token=secret"
    uri = opener(isolated, address)
    page = isolated / OPEN_FILE
    assert uri == page.as_uri() and "secret" not in uri
    assert stat.S_IMODE(page.stat().st_mode) == 0o600 and f'content="0;url={address}"' in page.read_text()


def test_the_event_stream_says_when_the_view_changed_and_one_poller_serves_all(isolated, gpuctl, make_project):
    gpuctl("up", "--name", "lab")
    with dashboard(isolated, interval=0.3) as d, _client(d, d.token) as c:
        with c.stream("GET", "/api/events") as events:
            lines = events.iter_lines()
            assert next(lines) == "event: changed"
            first = int(next(lines).split(": ")[1])
            gpuctl("train", make_project("p", {"train.py": QUICK_TRAIN}), "--wait")
            for line in lines:
                if line.startswith("data: "):
                    assert int(line.split(": ")[1]) > first
                    break
        runs = wait_for(lambda: [r for r in c.get("/api/view").json()["view"]["runs"]
                                 if r["status"]["state"] == "succeeded" and r["status"]["epoch"] == 2], 30, "the run done")
        assert len(runs) == 1
        detail = c.get("/api/view", params={"run": runs[0]["status"]["run_id"]}).json()["run"]
        assert [e["epoch"] for e in detail["cost"]["epochs"]] == [1, 2]
        assert c.get("/api/view", params={"run": "nope"}).json()["run"] is None


def test_many_clients_cost_no_more_looks_than_one(isolated, gpuctl, make_project):
    """Eight clients, each with an event stream open and asking for the view as fast as it can,
    for 3 s: the poller still looks once per interval (1 s), not once per request."""
    import threading
    import time

    gpuctl("up", "--name", "lab")
    gpuctl("train", make_project("p", {"train.py": QUICK_TRAIN}), "--wait")
    with dashboard(isolated, interval=1.0) as d:
        stop = threading.Event()
        asked = []

        def client() -> None:
            with _client(d, d.token) as c, c.stream("GET", "/api/events"):
                while not stop.is_set():
                    asked.append(c.get("/api/view").status_code)

        with _client(d, d.token) as c:
            before = c.get("/api/view").json()["looks"]
            threads = [threading.Thread(target=client) for _ in range(8)]
            start = time.monotonic()
            for t in threads:
                t.start()
            stop.wait(3)
            stop.set()
            for t in threads:
                t.join()
            looks = c.get("/api/view").json()["looks"] - before
            took = time.monotonic() - start
    assert len(asked) > 8 * 3 and set(asked) == {200}
    assert looks <= took / 1.0 + 1, (looks, took, len(asked))


def test_a_second_dashboard_prints_the_first_and_the_runtime_file_is_private(isolated, gpuctl):
    with dashboard(isolated) as d:
        runtime = isolated / RUNTIME_FILE
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o600
        again = gpuctl("dashboard", "--no-open")
        assert again.stdout.strip() == f"A dashboard is running already: {d.url}"
    assert not runtime.exists()  # SIGTERM ends it as Ctrl-C does: the file goes with it
    # The token is in no file of the home but the runtime file (gone now): not in the ledger.
    for path in isolated.rglob("*"):
        if path.is_file():
            assert d.token.encode() not in path.read_bytes(), path


def test_a_stale_runtime_file_is_not_believed(isolated):
    isolated.mkdir(parents=True, exist_ok=True)
    (isolated / RUNTIME_FILE).write_text(json.dumps({"pid": 1, "port": 1, "token": "old"}))
    with dashboard(isolated) as d:
        assert d.token != "old"


def test_bad_inputs_are_one_line_errors(isolated, gpuctl):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        res = gpuctl("dashboard", "--no-open", "--port", str(port), code=5)
        assert res.stderr.splitlines() == [f"Error: port {port} on 127.0.0.1 is in use",
                                           "Hint: Pass another --port, or leave --port out to take a free one."]
    finally:
        taken.close()
    assert not (isolated / RUNTIME_FILE).exists()
    for flags in (("--port", "70000"), ("--interval", "0")):
        assert "Invalid value" in gpuctl("dashboard", "--no-open", *flags, code=2).stderr


def test_only_the_pages_own_assets_are_served(isolated):
    # One server for every path (each start costs seconds of the fast tier).
    with dashboard(isolated) as d, _client(d, d.token) as c:
        for path in ("/static/..%2Fserver.py", "/static/..%2F..%2Fcli%2F__init__.py", "/static/index.html",
                     "/static/nope.js", "/static/assets%2Fapp.js"):
            assert c.get(path).status_code in (401, 404), path  # a public asset by its exact name only


def test_the_cli_loads_no_web_framework_but_for_the_dashboard():
    """`gpuctl --help` and every other command stay as fast as before: Starlette and uvicorn are
    imported inside the dashboard command only."""
    import subprocess
    import sys

    code = ("import sys; from gpuctl.cli import cli; import gpuctl.ops.costs; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn', 'anyio')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
