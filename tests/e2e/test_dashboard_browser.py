"""Issue 39 in a real browser: headless Chromium (Debian's) driven by Playwright against a real
`gpuctl dashboard` over real local runs (real tmux, a stdlib script reporting epochs through
gpuctl_report: the page is what is tested, not TensorFlow).

DASHBOARD_SCREENSHOT=PATH makes the live-run test write its screenshot there too (docs/dashboard.png
is made so)."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import threading

import pytest

from tests.web import dashboard, wait_for

pytestmark = pytest.mark.browser

HOSTILE = "<img src=x onerror=window.__pwned=1>"
# Epochs through gpuctl_report (a stdlib script: the page is tested, not TensorFlow): with
# `hostile`, a metric named like markup, a log line with a script, three epochs; else five epochs
# of a plausible run, the fourth once the test says so (the file named by its argument exists).
SCRIPT = """
import os, sys, time
import gpuctl_report

cfg = gpuctl_report.run_config()
writer = gpuctl_report.ReportWriter.shared(cfg["report_path"], cfg["run_id"], cfg["usd_per_hour"])
go = sys.argv[1] if len(sys.argv) > 1 else None
print(%(first_line)r, flush=True)
for epoch in range(1, 6):
    if epoch == 4 and go:
        while not os.path.exists(go):
            time.sleep(0.1)
    start = time.time()
    time.sleep(%(epoch_s)r)
    metrics = {"loss": round(2.3 / epoch, 4), %(metric)r: round(1 - 0.6 / epoch, 4)}
    writer.write(start, time.time(), 50000, False, 5, metrics)
    print("epoch %%d/5: loss %%.4f" %% (epoch, metrics["loss"]), flush=True)
    if epoch == 3 and not go:
        break
if go:
    time.sleep(600)
"""
REPORTS = SCRIPT % {"first_line": "<script>window.__pwned=2</script> starting", "epoch_s": 0.3, "metric": HOSTILE}
LIVE = SCRIPT % {"first_line": "training ResNet-20 on CIFAR-10 (stand-in: no TensorFlow here)", "epoch_s": 1.2,
                 "metric": "accuracy"}


def _open(browser, d):
    page = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.accept()))
    page.on("pageerror", lambda exc: dialogs.append(f"script error: {exc}"))  # a broken page fails the test
    page.on("console", lambda msg: msg.type == "error" and dialogs.append(f"console error: {msg.text}"))
    page.goto(d.url)
    page.wait_for_selector("#runs tr.clickable")
    return page, dialogs


def _row(page, run_id: str) -> list[str]:
    return page.locator(f'#runs tr[data-run="{run_id}"] td').all_inner_texts()


def test_the_page_shows_the_same_dollars_as_cost_json_and_no_hostile_name_runs(isolated, gpuctl, make_project,
                                                                                monkeypatch, browser):
    monkeypatch.setenv("GPUCTL_LOCAL__USD_PER_HOUR", "3.6")
    gpuctl("up", "--name", "lab", "-y")
    proj = make_project("cifar", {"train.py": REPORTS})
    run = json.loads(gpuctl("train", proj, "--wait", "--json").stdout)["run"]["run_id"]
    gpuctl("down", "lab", "-y")  # its dollars stop growing: the page and `cost --json` see the same total
    plan = json.loads(gpuctl("plan", proj, "--from-history", "--epochs", "50", "--json").stdout)
    cost = json.loads(gpuctl("cost", "--json").stdout)
    rc = next(r for r in cost["runs"] if r["run_id"] == run)
    with dashboard(isolated) as d:
        page, dialogs = _open(browser, d)
        page.locator(f'#runs tr[data-run="{run}"]').click()
        page.wait_for_selector("#run-epochs tr:nth-child(4)")
        cells = _row(page, run)
        assert cells[2] == "succeeded" and cells[3] == "3/5"
        assert cells[6] == _usd(rc["spent_usd"]) and cells[7] == _usd(rc["projected_total_usd"])
        epochs = page.locator("#run-epochs tr").all()[1:]
        assert [e.locator("td").nth(5).inner_text() for e in epochs] == [_usd(e["cumulative_usd"]) for e in rc["epochs"]]
        assert page.locator("#spend .figure").nth(3).inner_text() == _usd(cost["total_usd"])
        # The chart: the spent line and the dashed projection to epoch 5.
        assert page.locator("#run-chart polyline.spent").count() == 1
        assert page.locator("#run-chart polyline.projected").count() == 1
        # The latest plan: its ranked table and its dollars-against-hours chart.
        assert page.locator("#plan tr").count() == 1 + len(plan["rows"]) >= 2
        assert page.locator("#plan tr").nth(1).locator("td").nth(6).inner_text() == _usd(plan["rows"][0]["projected_usd"])
        assert page.locator("#plan-chart polyline").count() == len(plan["rows"])
        # The hostile metric name and log line are text on the page, and nothing of them ran.
        assert HOSTILE in page.locator(f'#runs tr[data-run="{run}"]').inner_text()
        assert "<script>window.__pwned=2</script> starting" in page.locator("#run-log").inner_text()
        assert page.evaluate("window.__pwned") is None and page.locator("#runs img").count() == 0
        assert dialogs == []


def _usd(x: float | None) -> str:
    if x is None:
        return "-"
    return f"${x:.4f}" if abs(x) < 10 else f"${x:.2f}"


def test_a_new_epoch_appears_without_a_reload_and_stop_on_the_page_stops_the_run(isolated, gpuctl, make_project,
                                                                                 browser, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCTL_LOCAL__USD_PER_HOUR", "1.006")  # a g5.xlarge's, for the screenshot
    monkeypatch.setenv("GPUCTL_GUARDS__CHECK_INTERVAL", "1s")  # the watchdog's state.json comes soon
    monkeypatch.setenv("GPUCTL_GUARDS__BUDGET_USD", "10")  # at $1.006/h it fires in 9 h 56 min
    gpuctl("up", "--name", "lab", "-y")
    go = tmp_path / "go"
    run = json.loads(gpuctl("train", make_project("cifar10", {"train.py": LIVE}), "--json", "--", str(go)).stdout)[
        "run"]["run_id"]
    with dashboard(isolated) as d:
        page, dialogs = _open(browser, d)
        wait_for(lambda: _row(page, run)[3] == "3/5", 60, "epoch 3 on the page")
        # The guards as the instance's watchdog wrote them, counting down (a local cluster arms no
        # hard cap: nothing is rented; the budget guard counts).
        wait_for(lambda: "budget in 9h5" in page.locator("#clusters").inner_text(), 30, "the budget's countdown")
        assert re.search(r"budget left \$9\.9\d{3}", page.locator("#clusters").inner_text())
        page.evaluate("window.__same_page = true")  # gone if the page were loaded again
        go.write_text("")
        wait_for(lambda: _row(page, run)[3] == "4/5", 30, "epoch 4 on the page without a reload")
        assert page.evaluate("window.__same_page") is True
        page.locator(f'#runs tr[data-run="{run}"]').click()
        page.wait_for_selector("#run-epochs tr:nth-child(5)")
        shot = isolated.parent / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("DASHBOARD_SCREENSHOT"):
            shutil.copy(shot, os.environ["DASHBOARD_SCREENSHOT"])
        page.locator(f'#runs tr[data-run="{run}"] button').click()
        wait_for(lambda: "Stopped" in page.locator("#banner").inner_text(), 60, "the stop's answer")
        assert dialogs == [f"Stop run {run}? The cluster stays up."]
        assert json.loads(gpuctl("status", run, "--json").stdout)["runs"][0]["state"] == "stopped"
        wait_for(lambda: _row(page, run)[2] == "stopped", 30, "stopped on the page")


class _Evil(http.server.BaseHTTPRequestHandler):
    """A page of another origin that tries to read the dashboard and to act on it."""

    target = ""

    def do_GET(self):
        body = f"""<script>
        window.results = {{}};
        fetch("{self.target}/api/view", {{credentials: "include"}}).then(r => r.text())
          .then(t => window.results.read = t, e => window.results.read = "blocked");
        fetch("{self.target}/api/stop", {{method: "POST", credentials: "include", mode: "no-cors",
          headers: {{"Content-Type": "text/plain"}}, body: JSON.stringify({{target: "{self.server.run}"}})}})
          .then(() => window.results.posted = true, () => window.results.posted = "blocked");
        </script>""".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_page_without_the_token_or_from_another_origin_can_neither_read_nor_act(isolated, gpuctl, make_project,
                                                                                   browser, tmp_path):
    gpuctl("up", "--name", "lab")
    run = json.loads(gpuctl("train", make_project("live", {"train.py": REPORTS}), "--json", "--",
                            str(tmp_path / "never")).stdout)["run"]["run_id"]
    with dashboard(isolated) as d:
        bare = browser.new_page()
        bare.goto(d.base + "/")  # the shell, without the token: it shows nothing of the ledger
        wait_for(lambda: "answered 401" in bare.locator("#banner").inner_text(), 30, "the 401 on the page")
        assert bare.locator("#runs tr").count() == 0
        page, _ = _open(browser, d)  # the real page, with its token, open in this browser
        evil = http.server.HTTPServer(("127.0.0.1", 0), type("Evil", (_Evil,), {"target": d.base}))
        evil.run = run  # type: ignore[attr-defined]
        threading.Thread(target=evil.serve_forever, daemon=True).start()
        try:
            other = page.context.new_page()
            other.goto(f"http://127.0.0.1:{evil.server_address[1]}/")
            results = wait_for(lambda: (lambda r: r if "read" in r and "posted" in r else None)(
                other.evaluate("window.results")), 30, "the other origin's tries")
            assert results["read"] == "blocked"  # no CORS header: the answer is not the page's to read
        finally:
            evil.shutdown()
        assert json.loads(gpuctl("status", run, "--json").stdout)["runs"][0]["state"] == "running"
