"""The watchdog on real sshd test hosts, with intervals of a second or two, `on_fire = poweroff`
and a poweroff command that only leaves a mark in the host's own /srv. The hosts have a real
/run/utmp, as an Ubuntu instance does: every tmux pane (the watchdog's own, a job's, TensorBoard's)
is recorded there, and so is every pty login through sshd (tests/sshd.py Login).

Bad inputs tried: a duration like "5 parsecs", a negative budget, an idle limit shorter than the
check interval (each refused, the instance's config unchanged). Bad cases tried for the idle
guard: only tmux panes in utmp (gpuctl's, a TensorBoard session, the user's own tmux), a login
typing for longer than the kernel's 8-second slot of terminal times, a login left open with no
input by a client that went to sleep (SIGSTOP: the connection stays open, sshd sees nothing), a
job ended with Ctrl-C in its pane, and one whose script was killed with SIGKILL."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests import sshd
from tests.conftest import MARK
from tests.integration.test_ssh import up_ssh
from tests.sshd import ROOT
from tests.waits import wait_for

GPUCTL = [sys.executable, "-m", "gpuctl"]  # the CLI as a user runs it, in a process of its own



def fired(host):
    res = host.run(f"cat {ROOT}/guard/fired.json")
    return json.loads(res.stdout) if res.returncode == 0 and res.stdout.strip() else None


def wait_fired(host, timeout=30):
    """fired.json once the watchdog has fired; else fail showing its last decisions."""
    try:
        return wait_for(lambda: fired(host), timeout=timeout)
    except AssertionError:
        log = host.run(f"tail -n 25 {ROOT}/guard/decisions.log; tail -n 5 {ROOT}/guard/watchdog.out").stdout
        raise AssertionError(f"the watchdog did not fire in {timeout}s; it logged:\n{log}") from None


def marks(host):
    return host.run(f"cat {MARK} 2>/dev/null").stdout.split()


def test_idle_fires_within_one_interval_after_the_limit(gpuctl, fast_guards):
    host = fast_guards.hosts[0]
    t_up = time.time()
    out = up_ssh(gpuctl, fast_guards).stderr
    assert "watchdog: tmux session gpuctl-watchdog" in out
    f = wait_for(lambda: fired(host))
    assert f["reason"] == "idle" and f["action"] == "poweroff"
    assert marks(host), "the poweroff command ran"
    # idle for 3 s, checked every 1 s: it fires between 3 and 4 s (+ start-up) after it began.
    log = host.run(f"cat {ROOT}/guard/decisions.log").stdout
    assert "FIRE idle: idle for" in log and "-> poweroff" in log
    assert 3.0 <= f["at"] - t_up <= 3.0 + 1.0 + 6.0
    status = gpuctl("status").stdout
    assert "guard FIRED: idle" in status
    assert "FIRE idle" in gpuctl("logs", "--guard").stdout


def fire_times(host, reason):
    import datetime as dt

    out = []
    for line in host.run(f"cat {ROOT}/guard/decisions.log").stdout.splitlines():
        stamp, _, text = line.partition(" ")
        if text.startswith(f"FIRE {reason}"):
            out.append(dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp())
    return out


def ticks(log: str) -> list[tuple[float, str]]:
    """The watchdog's looks in its decisions.log: (when, by its clock to the second; what it decided,
    "ok" or "fire REASON"), in order."""
    import datetime as dt

    out = []
    for line in log.splitlines():
        stamp, _, text = line.partition(" ")
        if text.startswith("jobs="):  # a look's line (gpuctl_watchdog.tick)
            out.append((dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp(), text.rpartition(" -> ")[2]))
    return out


def test_never_fires_while_training_then_idle_after(gpuctl, fast_guards, make_project):
    host = fast_guards.hosts[0]
    up_ssh(gpuctl, fast_guards)
    proj = make_project("busy", {"train.py": "import time\nfor i in range(16):\n    print(i, flush=True)\n    time.sleep(0.5)\n"})
    res = gpuctl("train", proj, "--allow-cpu", "--wait")
    assert "15" in res.stdout
    start = float(host.run(f"stat -c %Y {ROOT}/runs/*/job.sh").stdout.split()[0])
    end = float(host.run(f"stat -c %Y {ROOT}/runs/*/exitcode").stdout.split()[0])
    assert end - start >= 7
    # Once the run is over, idle fires again after its 3 s (+ one 1 s interval).
    after = wait_for(lambda: [t for t in fire_times(host, "idle") if t >= end])
    assert end + 3 - 1 <= after[0] <= end + 3 + 1 + 2
    # And never while it trained (second-resolution log stamps: a second of slack each side).
    assert not [t for t in fire_times(host, "idle") if start + 1 < t < end - 1]


# A job that saves on its way out, as a script's try/finally or Keras's own stop at a batch end
# inside fit (the launcher's, tested with real TensorFlow in test_payload_tf.py) lets it.
SAVES_ON_SIGTERM = """
import os, time
import gpuctl_report
try:
    while True:
        time.sleep(0.2)
        gpuctl_report.report_epoch(examples=10)
finally:
    open(os.path.join(os.environ["GPUCTL_OUTPUT_DIR"], "checkpoint.txt"), "w").write("saved")
    print("checkpoint written", flush=True)
"""


def test_budget_stops_the_job_gracefully_then_fires(gpuctl, fast_guards, make_project, monkeypatch):
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    monkeypatch.setenv("GPUCTL_GUARDS__GRACE", "20s")
    up_ssh(gpuctl, fast_guards, extra=("--usd-per-hour", "3600"))  # $1 a second
    proj = make_project("costly", {"train.py": SAVES_ON_SIGTERM})
    run_id = json.loads(gpuctl("train", proj, "--allow-cpu", "--json").stdout)["run"]["run_id"]
    # The budget is set once the job reports epochs (its try block has begun).
    wait_for(lambda: host.run(f"test -s {ROOT}/runs/{run_id}/epochs.jsonl").returncode == 0, timeout=120)
    spent = json.loads(host.run(f"cat {ROOT}/guard/state.json").stdout)["spent_usd"]
    gpuctl("guard", "set", "--budget", str(int(spent) + 6))
    f = wait_for(lambda: fired(host), timeout=90)
    assert f["reason"] == "budget"
    wait_for(lambda: marks(host))  # powered off once the job had stopped
    assert host.run(f"cat {ROOT}/runs/{run_id}/outputs/checkpoint.txt").stdout == "saved"  # its hook ran
    run = wait_for(lambda: next((r for r in json.loads(gpuctl("status", "--json").stdout)["runs"]
                                 if r["state"] != "running"), None), every=1)
    assert run["state"] == "stopped" and run["exit_code"] == 143  # SIGTERM, after a graceful exit
    assert "checkpoint written" in gpuctl("logs", run_id).stdout


@pytest.mark.parametrize("exit_code", [0, 3])
def test_down_fires_after_success_and_after_failure_with_the_client_gone(gpuctl, fast_guards, make_project,
                                                                        monkeypatch, exit_code):
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    up_ssh(gpuctl, fast_guards)
    proj = make_project("once", {"train.py": f"import sys, time\ntime.sleep(2)\nsys.exit({exit_code})\n"})
    gpuctl("train", proj, "--allow-cpu", "--down")
    # From here on the client does nothing at all: only the host's own files are looked at.
    f = wait_for(lambda: fired(host), timeout=60)
    assert f["reason"] == "run-done"
    end = float(host.run(f"stat -c %Y {ROOT}/runs/*/exitcode").stdout.split()[0])
    assert f["at"] >= end + 2.0 - 1.0  # after the grace period
    assert marks(host)


def test_watchdog_killed_with_sigkill_comes_back(gpuctl, fast_guards, monkeypatch):
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    up_ssh(gpuctl, fast_guards)

    def pid():
        # The Python process itself, not the shell loop around it that restarts it.
        found = host.pids(rb"^\S*python\S* \S*gpuctl_watchdog\.py")
        return found[0] if found else None

    first = wait_for(pid)
    host.run(f"kill -9 {first}")
    second = wait_for(lambda: (p := pid()) and p != first and p)
    assert second != first
    # Its first line comes a moment after its process does.
    wait_for(lambda: host.run(f"cat {ROOT}/guard/decisions.log").stdout.count("watchdog started") == 2, timeout=10)


def test_guard_set_and_show_and_bad_values_change_nothing(gpuctl, fast_guards, monkeypatch):
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    up_ssh(gpuctl, fast_guards)
    report = json.loads(gpuctl("guard", "set", "--idle", "30m", "--budget", "20", "--json").stdout)
    assert report["config"]["idle_s"] == 1800 and report["config"]["budget_usd"] == 20
    before = host.run(f"cat {ROOT}/guard/config.json").stdout
    for args, needle in [(["--idle", "5 parsecs"], "not a duration"),
                         (["--budget", "-1"], "guards.budget_usd"),
                         (["--idle", "10s", "--check-interval", "1m"], "shorter than check_interval")]:
        res = gpuctl("guard", "set", *args, code=3)
        assert needle in res.stderr and "Traceback" not in res.stderr
        assert host.run(f"cat {ROOT}/guard/config.json").stdout == before
    shown = gpuctl("guard", "show").stdout
    assert "idle" in shown and "30m" in shown and "$20" in shown


# --- who is there: utmp as on Ubuntu ----------------------------------------------------------------


def decisions(host):
    return host.run(f"cat {ROOT}/guard/decisions.log").stdout


def guard_state(host):
    return json.loads(host.run(f"cat {ROOT}/guard/state.json").stdout or "{}")


def logins_in_utmp(host):
    """`who -u` lines of sshd logins (not tmux panes)."""
    return [line for line in host.who() if "tmux(" not in line]


def user_records(host):
    """(pid, line, host) of every USER_PROCESS record in the host's utmp, stale ones included
    (`who` hides a record whose pid is gone), read by util-linux's utmpdump."""
    out = []
    for row in host.run("utmpdump /run/utmp 2>/dev/null").stdout.splitlines():
        fields = [f.strip() for f in row.split("] [")]
        if len(fields) >= 6 and fields[0] == "[7":
            out.append((int(fields[1]), fields[4], fields[5]))
    return out


def test_the_hosts_record_tmux_panes_and_pty_logins_in_utmp(ssh, tmp_path):
    """The test world as an instance: tmux (linked with libutempter) records each pane, sshd each
    pty login, in the host's own /run/utmp; a logout or a closed pane removes its line."""
    host = ssh.hosts[0]
    assert host.run("test -f /run/utmp && test -d /run/sshd").returncode == 0
    assert host.who() == []
    host.run("tmux -L gpuctl new-session -d -s tensorboard 'sleep 600'")
    assert [line for line in host.who() if "tmux(" in line], host.who()
    known = tmp_path / "known_hosts"
    known.write_text(f"{host.ip} {host.pubkey}\n")
    with sshd.Login(host.ssh_argv(ssh.key, known)) as login:
        login.type("echo $((6*7))\n")
        login.wait_for("42")
        line = wait_for(lambda: logins_in_utmp(host))[0]
        assert line.split()[1].startswith("pts/") and f"({host.gateway})" in line  # from this machine
    wait_for(lambda: not logins_in_utmp(host))
    host.run("tmux -L gpuctl kill-server")
    # The pane's line goes when tmux's utempter helper has run, which kill-server does not wait
    # for (ci27 saw it still there at once, on a loaded machine).
    wait_for(lambda: host.who() == [])


def test_idle_fires_when_only_tmux_panes_are_recorded(gpuctl, fast_guards, monkeypatch):
    """Before: every tmux pane in utmp counted as an SSH session, the watchdog's own among them,
    so idle never fired on an instance (`ssh=1 -> ok` until the boot hard cap)."""
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "4s")
    # A TensorBoard left running on a tmux server of an earlier gpuctl and the user's own tmux with a shell.
    host.run("tmux -L gpuctl new-session -d -s tensorboard 'sleep 600' \\; set-option -t tensorboard remain-on-exit on;"
             " tmux new-session -d -s mine")
    try:
        t_up = time.time()
        up_ssh(gpuctl, fast_guards)
        f = wait_fired(host)
        assert f["reason"] == "idle" and marks(host)
        print(f"figure: idle fired {f['at'] - t_up:.1f}s after `up` began, with only tmux panes in utmp")
        assert 4.0 <= f["at"] - t_up <= 4.0 + 1.0 + 6.0  # idle limit + one interval (+ start-up)
        panes = [line for line in host.who() if "tmux(" in line]
        assert len(panes) >= 3, host.who()  # the watchdog's pane, TensorBoard's, the user's shell
        assert "not counted: 3 tmux pane" in f["detail"]
        assert "ssh=0 [not counted: 3 tmux pane]" in decisions(host)
        ignored = guard_state(host)["logins"]["ignored"]
        assert {e["why"] for e in ignored} == {"tmux pane"} and all(e["host"].startswith("tmux(") for e in ignored)
    finally:
        host.run("tmux kill-server")


def test_a_typing_login_holds_idle_off_and_idle_fires_after_it_leaves(gpuctl, fast_guards, monkeypatch):
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    up_ssh(gpuctl, fast_guards)
    with sshd.Login([*GPUCTL, "ssh"]) as login:  # `gpuctl ssh` on a terminal: a pty login
        login.type("echo $((6*7))\n")
        login.wait_for("42")
        wait_for(lambda: logins_in_utmp(host))
        gpuctl("guard", "set", "--idle", "4s")
        # Typing once a second for 14 s: past the idle limit and past the kernel's 8-second slot
        # in which a terminal's access time does not move.
        t_set = time.time()
        while time.time() < t_set + 14:
            login.type(": tick\n")
            time.sleep(1)
        assert not fired(host), decisions(host)[-2000:]
        st = guard_state(host)
        assert st["ssh_sessions"] == 1 and st["logins"]["counted"][0]["line"].startswith("pts/")
        assert "ssh=1 (root@pts/" in decisions(host)
        login.type("exit\n")
        assert login.proc.wait(10) == 0
        t_exit = time.time()
    f = wait_fired(host)
    assert f["reason"] == "idle"
    # Counted from the last keystroke (at most a second before the logout): limit + one interval.
    print(f"figure: idle fired {f['at'] - t_exit:.1f}s after the typing login logged out")
    assert t_exit + 4.0 - 2.5 <= f["at"] <= t_exit + 4.0 + 1.0 + 2.0, (f["at"] - t_exit, decisions(host)[-1500:])


def test_a_login_with_no_input_stops_counting_after_the_idle_limit(gpuctl, fast_guards, monkeypatch):
    """A laptop that went to sleep with a login open: sshd keeps the connection (no
    ClientAliveInterval), utmp keeps the login, but its terminal sees no input."""
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    up_ssh(gpuctl, fast_guards)
    known = Path(os.environ["GPUCTL_HOME"]) / "known_hosts"  # pinned by `up`
    with sshd.Login(host.ssh_argv(fast_guards.key, known)) as login:
        wait_for(lambda: logins_in_utmp(host))
        t_login = time.time()  # no keystroke from here on
        login.pause()
        wait_for(lambda: "ssh=1 (root@pts/" in decisions(host))  # counted while the limit is off
        gpuctl("guard", "set", "--idle", "4s")
        f = wait_fired(host, timeout=40)
        assert f["reason"] == "idle" and "not counted: 1 no input for" in f["detail"]
        assert login.alive() and logins_in_utmp(host)  # the login is still open when it fires
        # Quiet for the limit, by the terminal's access time (moved in 8-second slots), + an interval.
        print(f"figure: idle fired {f['at'] - t_login:.1f}s after the quiet login's last input")
        assert t_login + 4.0 - 1.0 <= f["at"] <= t_login + 4.0 + 8.0 + 1.0 + 3.0, f["at"] - t_login
        ignored = [e for e in guard_state(host)["logins"]["ignored"] if e["why"].startswith("no input for")]
        assert ignored and ignored[0]["line"].startswith("pts/")


def test_a_stale_login_record_does_not_count(gpuctl, fast_guards, monkeypatch, tmp_path):
    """sshd killed with SIGKILL mid-session never writes the logout: utmp keeps the login record
    (utmpdump shows it; `who` hides records whose process is gone) while its shell is gone."""
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")
    up_ssh(gpuctl, fast_guards)
    known = Path(os.environ["GPUCTL_HOME"]) / "known_hosts"
    with sshd.Login(host.ssh_argv(fast_guards.key, known)) as login:
        login.type("echo $((6*7))\n")
        login.wait_for("42")
        line = wait_for(lambda: logins_in_utmp(host))[0]
        shell = int(line.split()[-2])  # who -u: ... PID (HOST)
        record = next(r for r in user_records(host) if r[0] == shell)
        # The session's sshd (for root, one process: the one that would write the logout), not the listener.
        session = host.pids(rb"^sshd: root@pts/")
        assert len(session) == 1
        host.run(f"kill -KILL {session[0]}")
        wait_for(lambda: host.run(f"kill -0 {shell}").returncode != 0)  # the shell got its hangup
        assert record in user_records(host) and not logins_in_utmp(host)  # it stays; `who` hides it
        gpuctl("guard", "set", "--idle", "4s")
        t_set = time.time()
        f = wait_fired(host)
        assert f["reason"] == "idle" and "1 process gone" in f["detail"]
        assert f["at"] <= t_set + 4.0 + 1.0 + 3.0
        assert login.proc.wait(10) == 255  # the client saw its connection drop


# --- a run ended in its pane ------------------------------------------------------------------------


@pytest.mark.parametrize("how, code", [("ctrl-c", 130), ("sigkill", 137)])
def test_a_run_ended_in_its_pane_is_over_and_idle_fires_after(gpuctl, fast_guards, make_project, monkeypatch,
                                                              how, code):
    """Ctrl-C in `gpuctl attach` (C-c sent to the pane), or the job's script killed outright.
    Before: the dead pane was kept by remain-on-exit, has-session said "running" forever, and the
    watchdog never saw idle."""
    host = fast_guards.hosts[0]
    monkeypatch.setenv("GPUCTL_GUARDS__IDLE", "0")  # armed once the job runs (start-up is not this test's)
    up_ssh(gpuctl, fast_guards)
    proj = make_project("forever", {"train.py": "import time\nprint('training', flush=True)\ntime.sleep(600)\n"})
    run_id = json.loads(gpuctl("train", proj, "--allow-cpu", "--json").stdout)["run"]["run_id"]
    wait_for(lambda: "training" in host.run(f"cat {ROOT}/runs/{run_id}/output.log").stdout)
    t_set = time.time()
    gpuctl("guard", "set", "--idle", "4s")
    # Until the watchdog has looked well past the limit (its stamps are to the second), deciding nothing:
    wait_for(lambda: [t for t, _ in ticks(decisions(host)) if t >= t_set + 4.0 + 2.0], timeout=40)
    assert {d for t, d in ticks(decisions(host)) if t >= t_set - 1} == {"ok"}, decisions(host)[-1500:]
    assert not fired(host)  # the job keeps the instance busy
    if how == "ctrl-c":
        host.run(f"{sshd.gpuctl_tmux(host)} send-keys -t ={run_id}: C-c")
    else:
        pane_pid = host.run(f"{sshd.gpuctl_tmux(host)} list-panes -t ={run_id}: -F '#{{pane_pid}}'").stdout.strip()
        host.run(f"kill -KILL -{pane_pid}")  # the pane leads its process group: script, job, tee
    t_end = time.time()
    if how == "sigkill":  # the watchdog alone notices, records tmux's code and fires
        f = wait_fired(host)
        said = host.run(f"{sshd.gpuctl_tmux(host)} list-panes -t ={run_id}: "
                        "-F '#{pane_dead_status}|#{pane_dead_signal}'").stdout.strip()
        # tmux 3.3a never learns the status of about one SIGKILLed pane in 30 (it does not come
        # later either): the watchdog then has no code to record, and the run ends without one.
        if said == "|":
            code = None
            assert host.run(f"cat {ROOT}/runs/{run_id}/exitcode 2>/dev/null").stdout == ""
        else:
            assert host.run(f"cat {ROOT}/runs/{run_id}/exitcode").stdout.strip() == str(code), said
            assert f"run {run_id}: its pane died without recording an exit code; tmux says {code}" in decisions(host)
    run = wait_for(lambda: next((r for r in json.loads(gpuctl("status", "--json").stdout)["runs"]
                                 if r["state"] != "running"), None), timeout=20, every=1)
    assert run["state"] in ("failed", "stopped") and run["exit_code"] == code
    f = wait_fired(host)
    assert f["reason"] == "idle"
    print(f"figure: idle fired {f['at'] - t_end:.1f}s after the run's pane died ({how})")
    assert t_end + 4.0 - 1.0 <= f["at"] <= t_end + 4.0 + 1.0 + 3.0, f["at"] - t_end


def test_the_boot_user_data_starts_the_watchdog_and_it_powers_off_an_instance_nobody_trains_on(ssh):
    """The aws user data's idle guard, run on a test host as root as cloud-init
    would (its hard-cap half is left out: without systemd it would `shutdown -h` this machine)."""
    import base64

    from gpuctl.provision.aws.userdata import idle_guard_script

    host = ssh.hosts[0]
    script = idle_guard_script({"idle_s": 3, "check_interval_s": 1, "on_fire": "poweroff",
                                "poweroff_command": f"date +%s.%N >> {MARK}"}, "root", ROOT)
    encoded = base64.b64encode(script.encode()).decode()
    res = host.run(f"echo {encoded} | base64 -d > /tmp/user-data.sh && bash /tmp/user-data.sh")
    assert res.returncode == 0, res.stderr
    assert host.run("tmux -L gpuctl has-session -t =gpuctl-watchdog").returncode == 0  # as `train` would find it
    f = wait_fired(host)
    assert f["reason"] == "idle" and f["action"] == "poweroff"
    assert marks(host), "the poweroff command ran"
    cfg = json.loads(host.run(f"cat {ROOT}/guard/config.json").stdout)
    assert cfg["boot_guard"] is True and 0 < time.time() - cfg["started_at"] < 10 ** 7  # idle from boot
    host.run("tmux -L gpuctl kill-server")
