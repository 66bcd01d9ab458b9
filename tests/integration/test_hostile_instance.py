"""Files a hostile instance (or a buggy script) writes are planted where gpuctl reads them, on the
local provider (this machine plays the instance, real tmux, a real job) and on an sshd test host
(SFTP, the remote Python). `status`, `cost`, `logs`, `pull` and `down` succeed or give one-line
errors, no control sequence reaches the terminal, `down` ends every job, and nothing is written
outside the target.

Bad inputs tried: report lines with `"epoch": 1e20`, `start` 1e308, `Infinity`, `NaN`, a 100 KB line,
`[1,2]`, garbage, another run's id, metric names holding OSC title and CSI sequences; a ledger row
with `start` 1e308 stored by a gpuctl before the bounds; state.json of `[1,2,3]`, `"str"`, `123`,
`null`, `{"at": "abc"}`, `{"fired": ...}` with an OSC title in its detail and a time of 1e308,
`{"stalled": "abc"}`, `{"fires_at": [1]}`, `{"pid": "x"}`, `{"logins": [1]}`, a 100-deep nesting,
2 MB of JSON; guard/config.json of `[1,2]`; `ended` of `inf`, `started` of `nan`, an exit code of
20 digits, queue.json of `[[[...`; a log with escape sequences; a zlib bomb as the push manifest; an
immutable ledger at `up`; a preflight that answers `[1,2]`; a run tree deeper than PATH_MAX here."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import HOST_PYTHON, QUICK_TRAIN
from tests.integration.test_guards import wait_for

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # anything but tab and newline

# Two epochs, then it stays (so `down` has a job to end) and says where it is.
LINGERING = QUICK_TRAIN.replace('print("done", flush=True)', '''print("done", flush=True)
import os
out = os.environ["GPUCTL_OUTPUT_DIR"]
open(os.path.join(out, "pid.tmp"), "w").write(str(os.getpid()))
os.replace(os.path.join(out, "pid.tmp"), os.path.join(out, "pid"))  # whole when it appears (ci16 read it empty)
time.sleep(600)''')


def clean_and_ok(result, *needles: str) -> str:
    """The command succeeded and printed no control character (the text it printed)."""
    text = result.stdout + result.stderr
    assert result.exit_code == 0, text
    assert not CONTROL.search(text), repr(CONTROL.search(text).group()) + " in " + repr(text[:2000])
    assert "internal error" not in text and "Traceback" not in text
    for needle in needles:
        assert needle in text, (needle, text)
    return text


def one_line_error(result, code: int, needle: str) -> None:
    assert result.exit_code == code, result.stdout + result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr
    assert "Hint:" in result.stderr and "internal error" not in result.stderr and "Traceback" not in result.stderr
    assert not CONTROL.search(result.stderr)


def files_under(top: Path, *leave_out: Path) -> set[Path]:
    return {p for p in top.rglob("*") if not any(p == x or x in p.parents for x in leave_out)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (the test process is no parent of tmux's children, but be sure) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.fixture
def lingering_run(gpuctl, make_project, isolated, monkeypatch):
    """A local cluster whose run reported two epochs and keeps running; its files, its pid."""
    # The watchdog looks once at its start, then not for half an hour: what the tests plant in its
    # files stays there while gpuctl reads it.
    monkeypatch.setenv("GPUCTL_GUARDS__CHECK_INTERVAL", "30m")
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "1h")
    proj = make_project("hostile", {"train.py": LINGERING})
    gpuctl("up", "-y")
    run = json.loads(gpuctl("train", proj, "--json").stdout)["run"]
    run_dir = Path(run["run_dir"])
    pid_file = run_dir / "outputs" / "pid"
    wait_for(pid_file.exists, timeout=60)
    return SimpleNamespace(run_id=run["run_id"], dir=run_dir, root=run_dir.parent.parent,
                           pid=int(pid_file.read_text()), epochs=run_dir / "epochs.jsonl")


def poisoned_report_lines(good: dict) -> list[str]:
    other = dict(good, metrics={"\x1b]0;pwned\x07loss": 0.1, "\x1b[2J\x1b[31macc": 0.9, "\x9b31mbad": 1.0})
    return [
        json.dumps(dict(good, epoch=100000000000000000000)),  # made `status` and `down` fail
        json.dumps(dict(good, epoch=3, start=1e308)),
        json.dumps(dict(good, epoch=4, seconds=float("nan"))),  # NaN
        json.dumps(dict(good, epoch=5)).replace('"cumulative_usd": ', '"cumulative_usd": 1e400, "x": '),  # Infinity
        json.dumps(dict(good, epoch=6, run_id="somebody-else")),
        json.dumps(dict(other, epoch=7)),  # believable, with names that would retitle the terminal
        "[1,2]",
        "garbage {",
        json.dumps(dict(good, epoch=8, junk="x" * 100_000)),  # a line over 64 KB
    ]


@pytest.mark.parametrize("down", [("down", "-y"), ("down", "--force", "-y"), ("down", "--all", "-y")])
def test_report_lines_of_any_kind_block_nothing_and_down_ends_the_job(gpuctl, lingering_run, tmp_path, down):
    run = lingering_run
    good = json.loads(run.epochs.read_text().splitlines()[0])
    with open(run.epochs, "a") as fh:
        fh.write("\n".join(poisoned_report_lines(good)) + "\n")
    first = clean_and_ok(gpuctl("status"), "report lines of run", "ignored")
    assert "8 report lines" in first, first  # named once, each kind of fault said
    assert "report line" not in gpuctl("status").stderr  # ... and not again
    text = clean_and_ok(gpuctl("cost", run.run_id), "loss=0.1")  # epoch 7: its names cleaned, its numbers kept
    assert "7 " in text and "]0;pwned" not in text
    assert json.loads(gpuctl("cost", "--json").stdout)["runs"][0]["epochs_done"] == 3  # 1, 2 and 7
    clean_and_ok(gpuctl("logs", run.run_id), "done")
    before = files_under(tmp_path, tmp_path / "gpuctl-home")
    dest = tmp_path / "back"
    clean_and_ok(gpuctl("pull", run.run_id, "--dest", dest), "Pulled")
    assert files_under(tmp_path, tmp_path / "gpuctl-home", dest) == before - {dest}
    assert (dest / run.run_id / "epochs.jsonl").exists()
    clean_and_ok(gpuctl(*down), "is down")
    wait_for(lambda: not alive(run.pid), timeout=20)
    status = json.loads(gpuctl("status", "--json").stdout)
    assert status["runs"][0]["state"] == "stopped" and status["clusters"][0]["state"] == "down"
    clean_and_ok(gpuctl("cost"), "Total across clusters")


def test_a_ledger_poisoned_before_the_bounds_still_reports(gpuctl, lingering_run, isolated):
    """A 1e308 `start` that an earlier gpuctl stored: `cost` and `status` leave that row out."""
    gpuctl("down", "-y")
    db = sqlite3.connect(isolated / "ledger.sqlite3")
    row = json.loads(db.execute("SELECT report_json FROM epochs WHERE epoch = 2").fetchone()[0])
    db.execute("UPDATE epochs SET report_json = ? WHERE epoch = 2", (json.dumps(dict(row, start=1e308, end=1e308)),))
    db.commit()
    db.close()
    clean_and_ok(gpuctl("cost"), "Total across clusters")
    clean_and_ok(gpuctl("cost", lingering_run.run_id))
    clean_and_ok(gpuctl("status"))


STATES = [[1, 2, 3], "str", 123, None, {"at": "abc"}, {"stalled": "abc"}, {"fires_at": [1]}, {"pid": "x"},
          {"logins": [1]}, {"fired": {"reason": "idle", "detail": "d", "at": 1e308, "action": "poweroff"}},
          {"fires_at": {"idle": 1e308, "budget": "soon"}, "spent_usd": float("inf")},
          {"at": 1.7e9, "jobs": ["\x1b]0;pwned\x07job"], "stalled": ["\x1b[2Jrun"], "busy": [{"x": 1}],
           "fired": {"reason": "\x1b[31midle", "detail": "\x1b]2;title\x07\x1b[5mblink \x07\x08\x7f",
                     "at": 1.7e9, "action": "stop-jobs"}},
          {"a": json.loads("[" * 90 + "1" + "]" * 90)}]


@pytest.mark.parametrize("raw", [*(json.dumps(s) for s in STATES), "[" * 100_000 + "]" * 100_000, "x" * (2 << 20),
                                 "{\"at\": " + "9" * 5000 + "}"],
                         # Short ids: a 200 KB one went into PYTEST_CURRENT_TEST, and so into the
                         # environment of every process the test started (past exec's limit).
                         ids=lambda raw: raw if len(raw) <= 40 else f"{raw[:12]}...{len(raw)}B")
def test_guard_state_of_any_shape_reads_as_what_holds_of_it(gpuctl, lingering_run, raw):
    state = lingering_run.root / "guard" / "state.json"
    state.write_text(raw)
    clean_and_ok(gpuctl("status"))
    clean_and_ok(gpuctl("guard", "show"))
    json.loads(gpuctl("guard", "show", "--json").stdout)


def test_a_guard_config_of_the_wrong_shape_is_named_and_guard_set_replaces_it(gpuctl, lingering_run):
    config = lingering_run.root / "guard" / "config.json"
    config.write_text("[1, 2]")
    clean_and_ok(gpuctl("guard", "show"), "guard/config.json from local ignored: not an object (list)")
    clean_and_ok(gpuctl("guard", "set", "--idle", "2h"))
    assert json.loads(config.read_text())["idle_s"] == 7200.0
    clean_and_ok(gpuctl("down", "-y"))
    wait_for(lambda: not alive(lingering_run.pid), timeout=20)


def test_end_marks_exit_codes_and_queue_places_out_of_bounds(gpuctl, lingering_run):
    run = lingering_run
    (run.dir / "queue.json").write_text("[" * 60_000)
    clean_and_ok(gpuctl("status"))
    (run.dir / "started").write_text("nan\n")
    (run.dir / "ended").write_text("inf\n")
    (run.dir / "exitcode").write_text("9" * 20 + "\n")
    text = clean_and_ok(gpuctl("status", run.run_id))
    status = json.loads(gpuctl("status", "--json").stdout)["runs"][0]
    # A queue place that is not believed reads as "not placed yet" (ops/queue.py): queued.
    assert status["state"] in ("failed", "running", "queued") and status["elapsed_s"] < 3600, status
    assert "inf" not in text
    clean_and_ok(gpuctl("cost"))
    clean_and_ok(gpuctl("down", "-y"), "is down")
    wait_for(lambda: not alive(run.pid), timeout=20)


ESCAPES = "\x1b]0;pwned\x07\x1b[31mred\x1b[0m \x1b[2J\x9b1mC1\x1bPdcs\x1b\\ boom"


def test_escape_sequences_reach_the_terminal_through_logs_alone(gpuctl, make_project):
    proj = make_project("loud", {"train.py": f"import sys\nprint({ESCAPES!r}, flush=True)\nsys.exit(3)\n"})
    gpuctl("up", "-y")
    run_id = json.loads(gpuctl("train", proj, "--json").stdout)["run"]["run_id"]
    wait_for(lambda: json.loads(gpuctl("status", "--json").stdout)["runs"][0]["state"] == "failed", timeout=60)
    clean_and_ok(gpuctl("status"), "red C1 boom", "last lines of its log")
    raw = gpuctl("logs", run_id).stdout  # the job's own bytes, on purpose (Click drops CSI colours off a terminal)
    assert "\x1b]0;pwned\x07red" in raw and "\x9b1mC1\x1bPdcs\x1b\\ boom" in raw
    plain = gpuctl("logs", "--plain", run_id).stdout
    assert "red C1 boom" in plain and not CONTROL.search(plain)
    shown = " ".join(gpuctl("logs", "--help").stdout.split())
    assert "control sequences included (as `attach` shows it)" in shown and "--plain strips them" in shown


def test_a_zlib_bomb_as_the_push_manifest_is_one_line_error(gpuctl, make_project, isolated):
    proj = make_project("bombed", {"train.py": "print('x')\n"})
    gpuctl("up", "-y")
    gpuctl("sync", proj)
    (manifest,) = (isolated / "clusters" / "default" / "code").glob(".bombed-*.gpuctl-manifest")
    assert manifest.exists()
    z = zlib.compressobj(9)
    bomb = z.compress(b"[" + b" " * (64 << 20)) + z.flush()  # 64 MB of JSON in 64 KB
    manifest.write_bytes(bomb)
    res = gpuctl("sync", proj, code=7)
    one_line_error(res, 7, "expands past 16 MiB")
    assert "rm -f" in res.stderr
    manifest.unlink()
    gpuctl("sync", proj)


def test_a_ledger_that_cannot_be_written_is_a_one_line_error_at_up(gpuctl, isolated):
    gpuctl("status")  # makes the ledger
    ledger = isolated / "ledger.sqlite3"
    made = subprocess.run(["chattr", "+i", str(ledger)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr  # root on a filesystem with attributes: the test hosts need both
    try:
        one_line_error(gpuctl("up", "-y", code=3), 3, "cannot be written")
    finally:
        subprocess.run(["chattr", "-i", str(ledger)], check=True)
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []


# --- on an sshd test host: the remote Python, SFTP ---------------------------------------------------

def test_a_preflight_answering_a_list_is_one_line_error(gpuctl, ssh, quick_project, monkeypatch):
    from tests.integration.test_ssh import up_ssh

    host = ssh.hosts[0]
    python = HOST_PYTHON
    # The host's Python, as a compromised image might ship it: fine for everything but the preflight.
    host.run("cat > /srv/python <<'EOF'\n#!/bin/sh\ncase \"$1\" in *gpuctl_preflight.py) echo '[1,2]'; exit 0;; esac\n"
             f"exec {python} \"$@\"\nEOF\nchmod 755 /srv/python")
    monkeypatch.setenv("GPUCTL_REMOTE__PYTHON", "/srv/python")
    up_ssh(gpuctl, ssh)
    one_line_error(gpuctl("train", quick_project, "--allow-cpu", code=7), 7, "its report ignored: not an object (list)")
    clean_and_ok(gpuctl("status"))
    clean_and_ok(gpuctl("down", "-y"), "is down")


def test_an_sftp_pull_past_path_max_here_skips_what_does_not_fit(gpuctl, ssh, make_project, tmp_path):
    from tests.integration.test_ssh import up_ssh

    host = ssh.hosts[0]
    host.restart(hidden=("/usr/bin/rsync",))  # the SFTP walk
    up_ssh(gpuctl, ssh)
    proj = make_project("deep", {"train.py": "print('done')\n"})
    run = json.loads(gpuctl("train", proj, "--allow-cpu", "--wait", "--json").stdout)["run"]
    deep = "/".join(["d" * 200] * 12)  # 2.4 KB under the run's outputs there
    host.run(f"cd {run['run_dir']}/outputs && mkdir -p {deep} && echo w > {deep}/model.txt && echo k > keep.txt")
    dest = tmp_path / "/".join(["p" * 200] * 9)  # 1.8 KB here: together past PATH_MAX (4096)
    before = files_under(tmp_path, tmp_path / "gpuctl-home")
    res = gpuctl("pull", run["run_id"], "--dest", dest)
    clean_and_ok(res, "its path here would be too long")
    assert (dest / run["run_id"] / "outputs" / "keep.txt").read_text() == "k\n"
    made = files_under(tmp_path, tmp_path / "gpuctl-home") - before
    assert all(p == dest or p in dest.parents or dest in p.parents for p in made), sorted(made)[:5]
    gpuctl("down", "-y")
