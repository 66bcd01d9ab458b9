"""The idle guard and a `gpuctl notebook` server (payloads/gpuctl_decide.py, gpuctl_nbwatch.py):
a busy kernel is work, idle kernels are idle, and the notebook's users are warned before idle
fires. Pure decisions in milliseconds; the real JupyterLab, watchdog and log: tests/integration/
test_notebook.py. Bad answers tried for the server's API: refused, not JSON, not a list, too
large, kernels that are not objects."""

from __future__ import annotations

import http.server
import json
import sys
import threading

import pytest

from gpuctl.ops.guards import PAYLOAD_DIR

sys.path.insert(0, str(PAYLOAD_DIR))  # the payloads import each other by bare name, as on the instance
import gpuctl_decide as d  # noqa: E402
import gpuctl_nbwatch as nb  # noqa: E402

T0 = 1_000_000.0
NO_LOGINS = ("/run/utmp", [], [])
CFG = {"started_at": T0, "usd_per_hour": 3.6, "on_fire": "stop-jobs", "idle_s": 600.0}


def seen(notebook=None):
    return d.Observation([], None, NO_LOGINS, {}, None, False, {}, notebook)


def run_ticks(notebooks, step=60.0):
    """Decide every `step` s from T0 with these notebook looks; [(t, decision)]."""
    memory, out = d.FRESH, []
    for n, look in enumerate(notebooks):
        t = T0 + n * step
        dec = d.decide(CFG, seen(look), t, memory)
        memory = dec.memory
        out.append((t, dec))
    return out


def test_a_busy_kernel_is_work_the_idle_guard_never_fires_under_it():
    ticks = run_ticks([{"kernels": 2, "busy": 1}] * 30)  # 29 minutes of a running cell, idle limit 10
    assert all(dec.reason is None and dec.state["idle_since"] is None for _, dec in ticks)
    assert not any(dec.state["idle_warning"] for _, dec in ticks)


def test_idle_kernels_are_idle_it_fires_after_its_limit_warned_once_before():
    ticks = run_ticks([{"kernels": 1, "busy": 1}] + [{"kernels": 1, "busy": 0}] * 15)
    fired = [t for t, dec in ticks if dec.reason == "idle"]
    assert fired and fired[0] == T0 + 60 + 600  # idle from the first idle look, for 600 s
    warned = [(t, dec) for t, dec in ticks if dec.state["idle_warning"]]
    # The window is min(idle_warn_s = 300 s, idle_s / 2): the looks 300 s and less before it fires.
    assert [t for t, _ in warned] == [T0 + 60 + 300, T0 + 60 + 360, T0 + 60 + 420, T0 + 60 + 480, T0 + 60 + 540]
    assert all(dec.state["idle_warning"] == T0 + 660 for _, dec in warned)
    notes = [n for _, dec in ticks for n in dec.notes if n.startswith("WARN idle")]
    assert notes == ["WARN idle: the notebook's kernels are idle; the idle guard fires in 300s"]


def test_a_short_limit_still_warns_first_and_a_busy_kernel_starts_the_stretch_again():
    cfg = dict(CFG, idle_s=6.0)
    memory, warned = d.FRESH, []
    looks = [{"kernels": 1, "busy": 0}] * 4 + [{"kernels": 1, "busy": 1}] + [{"kernels": 1, "busy": 0}] * 8
    for n, look in enumerate(looks):
        dec = d.decide(cfg, seen(look), T0 + n, memory)
        memory = dec.memory
        warned += [(n, note) for note in dec.notes if note.startswith("WARN idle")]
        if dec.reason:
            break
    assert dec.reason == "idle" and n == 5 + 6  # idle again from the look after the busy one
    assert [n for n, _ in warned] == [3, 5 + 3]  # once per stretch, half the limit before it fires


def test_no_notebook_no_warning():
    memory, reasons = d.FRESH, []
    for n in range(12):
        dec = d.decide(CFG, seen(None), T0 + n * 60, memory)
        memory = dec.memory
        reasons.append(dec.reason)
        assert dec.state["idle_warning"] is None and not [x for x in dec.notes if x.startswith("WARN idle")]
    assert reasons[10] == "idle"


# --- the watchdog's look at the server's API -------------------------------------------------------


class Api(http.server.BaseHTTPRequestHandler):
    body = b"[]"
    seen_auth: list[str] = []

    def do_GET(self):  # noqa: N802
        Api.seen_auth.append(self.headers.get("Authorization", ""))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(Api.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def api(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    folder = tmp_path / "notebook"
    folder.mkdir()
    (folder / "port").write_text(str(server.server_address[1]))
    (folder / "token").write_text("t" * 32)
    (tmp_path / "runs").mkdir()
    yield str(tmp_path / "runs"), folder
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("body, expect", [
    (json.dumps([{"execution_state": "busy"}, {"execution_state": "idle"}]).encode(), {"kernels": 2, "busy": 1}),
    (b"[]", {"kernels": 0, "busy": 0}),
    (b"not json", None),
    (b'{"kernels": 3}', None),
    (b"[" + b'"x",' * (1 << 19) + b'"x"]', None),  # over a megabyte: not read on
    (b'[1, null, {"execution_state": "busy"}]', {"kernels": 3, "busy": 1}),
], ids=["busy", "none", "not-json", "not-a-list", "too-large", "odd-kernels"])
def test_the_look_asks_the_api_with_the_token_bounded(api, body, expect):
    runs_dir, folder = api
    Api.body, Api.seen_auth = body, []
    assert nb.look(runs_dir) == expect
    assert Api.seen_auth == ["token " + "t" * 32]


def test_no_server_an_ended_one_or_one_refusing_counts_nothing(api, tmp_path):
    runs_dir, folder = api
    (folder / "exitcode").write_text("0\n")
    assert nb.look(runs_dir) is None  # ended: not asked
    (folder / "exitcode").unlink()
    (folder / "port").write_text("1")  # nothing listens there
    assert nb.look(runs_dir) is None
    (folder / "token").write_text("short")
    assert nb.look(runs_dir) is None
    assert nb.look(str(tmp_path / "elsewhere" / "runs")) is None
