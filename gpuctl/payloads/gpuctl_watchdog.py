"""gpuctl's watchdog: runs on the instance and ends the spend by itself. Stdlib only; Python 3.8+.

Usage: python gpuctl_watchdog.py GUARD_DIR/config.json

Every check interval it reloads its config (so `gpuctl guard set` applies at once), looks at the
jobs, the GPU and the interactive logins, decides, and appends the decision and its reasons to
decisions.log; state.json holds the latest picture for `gpuctl status`. Guards:
  idle      no gpuctl job, GPU under the threshold (or no GPU), no input on any interactive login
            (see logins()), for `idle_s`
  stall     a job lives, its GPU is idle and its log has not grown for `stall_s`: warn (or fire)
  budget    $/h x uptime reaches `budget_usd`: stop the jobs gracefully (SIGTERM, grace), then fire
  run-done  `down_after_run`: a run ended (success or failure) and `grace_s` passed
Firing means `on_fire`: "poweroff" runs `poweroff_command`; "stop-jobs" stops gpuctl's jobs only.
The job-stopping code repeats gpuctl.remote.jobs on purpose: this file runs alone on the instance.
"""

import json
import os
import re
import stat
import struct
import subprocess
import sys
import time

WATCHDOG_SESSION = "gpuctl-watchdog"

# The login records, read directly: `who` output differs between coreutils versions and locales,
# and it hides the record's pid, which tells a live login from a stale record.
UTMP_PATHS = ("/run/utmp", "/var/run/utmp")
# glibc's `struct utmp` on Linux: type, pid, line, id, user, host, exit status, session, time,
# IPv6 address, reserved. On x86_64 (and 32-bit x86) glibc keeps the session and the time 32-bit
# for compatibility (__WORDSIZE_TIME64_COMPAT32): 384 bytes. On aarch64 (Graviton: g5g) and other
# 64-bit Linux they are 64-bit: 400 bytes. The time is field 9 in both.
UTMP_COMPAT32 = struct.Struct("=h2xi32s4s32s256s2hi2i4i20s")
UTMP_LP64 = struct.Struct("=h2xi32s4s32s256s2hqqq4i20s4x")


def utmp_record(size_of_file):
    """The record layout of this machine, checked against the file: one whose size the file is not a
    multiple of is the wrong one."""
    import platform

    native = UTMP_COMPAT32 if platform.machine() in ("x86_64", "amd64", "i386", "i686") else UTMP_LP64
    other = UTMP_LP64 if native is UTMP_COMPAT32 else UTMP_COMPAT32
    if size_of_file % native.size and not size_of_file % other.size:
        return other
    return native
USER_PROCESS = 7
# The host field of a pane's record (tmux via libutempter, GNU screen, an X terminal): not an
# address sshd would write ("::1" and other IPv6 addresses do not match).
MULTIPLEXER_HOST = re.compile(r"tmux\(|:(\d|pts/|tty)")
# Linux updates a terminal's access time (its last input) only when it moves to another 8-second
# slot, so that the timing of keystrokes cannot be read from it (tty_update_time). The last input
# lies before the end of the slot the access time is in: that end is what the idle guard counts from.
TTY_TIME_SLOT = 8


def log_line(guard_dir, text):
    with open(os.path.join(guard_dir, "decisions.log"), "a") as fh:
        fh.write("%s %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S%z"), text))


def write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def read_json(path, default=None):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def sh(argv, timeout=30):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def read_utmp():
    """(path, the USER_PROCESS records in it); (None, []) where the system keeps no utmp."""
    for path in UTMP_PATHS:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            break
        except OSError:
            continue
    else:
        return None, []
    out = []
    record = utmp_record(len(data))
    size = record.size
    for off in range(0, len(data) - size + 1, size):
        fields = record.unpack_from(data, off)
        if fields[0] != USER_PROCESS:
            continue
        text = [f.split(b"\0", 1)[0].decode("utf-8", "replace") for f in fields[2:6]]
        out.append({"pid": fields[1], "line": text[0], "user": text[2], "host": text[3], "at": fields[9]})
    return path, out


def proc_comm(pid):
    """The process's name, "" when there is no such process."""
    try:
        with open("/proc/%d/comm" % pid) as fh:
            return fh.read().strip() or "?"
    except (OSError, ValueError):
        return ""


def process_younger_than(pid, since):
    """Whether the process with `pid` started after `since` (plus slack): the pid was reused and
    the record that names it is stale. False when it cannot be told."""
    if since <= 0:  # no time in the record (or a 32-bit time past 2038)
        return False
    try:
        with open("/proc/%d/stat" % pid) as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return boot + ticks / float(os.sysconf("SC_CLK_TCK")) > since + 2
    except (OSError, ValueError, IndexError, StopIteration):
        return False


def summarize(ignored):
    """"2 tmux pane, 1 no input for 12s": why utmp records were not counted, for the log."""
    counts = {}
    for entry in ignored:
        counts[entry["why"]] = counts.get(entry["why"], 0) + 1
    return ", ".join("%d %s" % (n, why) for why, n in sorted(counts.items()))


def boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return None


def inherited_idle_since(previous, cfg, boot):
    """The idle start an earlier watchdog recorded, if it may count: written in this boot, for this
    cluster, and never before this cluster started (a host used by an earlier cluster, or a state
    file from before a reboot, must not make a new cluster look idle for ages: issue 10)."""
    since = previous.get("idle_since")
    if since is None or previous.get("boot_id") != boot or previous.get("cluster_key") != cfg.get("cluster_key"):
        return None
    return max(float(since), float(cfg.get("started_at", 0)))


class Watchdog(object):
    def __init__(self, config_path):
        self.config_path = config_path
        self.guard_dir = os.path.dirname(os.path.abspath(config_path))
        # A revived watchdog keeps counting idle time from where the last one left off, but only
        # if that one watched this cluster in this boot (checked on the first tick, with the config).
        self.previous = read_json(os.path.join(self.guard_dir, "state.json"), {}) or {}
        self.idle_since = None
        self.boot_id = boot_id()
        self.warned = set()

    # --- what is there ---------------------------------------------------------------------------

    def tmux(self, cfg, *args):
        return sh(["tmux", "-L", cfg["tmux_socket"]] + list(args))

    def runs(self, cfg):
        """[(run_id, run_dir, running, ended_at)] for every run gpuctl started on this host."""
        out = []
        runs_dir = cfg["runs_dir"]
        try:
            names = sorted(os.listdir(runs_dir))
        except OSError:
            return out
        for name in names:
            run_dir = os.path.join(runs_dir, name)
            if not os.path.isfile(os.path.join(run_dir, "job.sh")):
                continue
            code_path = os.path.join(run_dir, "exitcode")
            pane = None if os.path.exists(code_path) else self.pane(cfg, name)  # pane first, then the file
            if pane is not None and pane["dead"] and not os.path.exists(code_path):
                self.record_exit(run_dir, pane)
            if os.path.exists(code_path):
                out.append((name, run_dir, False, os.path.getmtime(code_path)))
                continue
            # A dead pane is over even when its exit code is unknown: remain-on-exit keeps it (and
            # its session) after the job ends, so the session's existence alone proves nothing.
            out.append((name, run_dir, bool(pane is not None and not pane["dead"]), None))
        return out

    def pane(self, cfg, name):
        """{"dead", "status", "signal", "time"} of the job's pane; None when its session is gone."""
        res = self.tmux(cfg, "list-panes", "-t", "=%s:" % name, "-F",
                        "#{pane_dead}|#{pane_dead_status}|#{pane_dead_signal}|#{pane_dead_time}")
        if res is None or res.returncode != 0 or not res.stdout.strip():
            return None
        dead, status, signal, at = (res.stdout.strip().split("\n")[0].split("|") + ["", "", ""])[:4]
        return {"dead": dead == "1", "status": status, "signal": signal, "time": at}

    def record_exit(self, run_dir, pane):
        """The job's script ended without writing its exit code (killed by a signal it cannot trap):
        record tmux's word for it, the fallback only (a pane can also die with its server). tmux
        before 3.3 gives no signal: the code stays unknown and the run is simply over."""
        if pane["status"].isdigit():
            code = int(pane["status"])
        elif pane["signal"].isdigit():
            code = 128 + int(pane["signal"])
        else:
            return
        ended = os.path.join(run_dir, "ended")
        if not os.path.exists(ended):
            at = float(pane["time"]) if pane["time"].isdigit() else time.time()
            with open(ended, "w") as fh:
                fh.write("%.3f\n" % at)
        tmp = os.path.join(run_dir, "exitcode.watchdog.tmp")
        with open(tmp, "w") as fh:
            fh.write("%d\n" % code)
        os.replace(tmp, os.path.join(run_dir, "exitcode"))
        log_line(self.guard_dir, "run %s: its pane died without recording an exit code; tmux says %d"
                 % (os.path.basename(run_dir), code))

    def gpu_utilization(self):
        res = sh(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"])
        if res is None or res.returncode != 0:
            return None
        values = [float(v) for v in res.stdout.split() if v.replace(".", "", 1).isdigit()]
        return max(values) if values else None

    def logins(self, now, idle_s):
        """(utmp path or None, counted, ignored): the interactive logins that keep the instance busy, and the other
        login records with why each does not count. Each is a dict for state.json.

        A login is a USER_PROCESS record in utmp: sshd writes one per pty session (gpuctl's own
        commands run without a pty and write none). Not counted:
          - tmux panes: tmux linked with libutempter (Debian, Ubuntu) records every pane, the
            watchdog's own and every job's among them; so does GNU screen. Their host reads
            "tmux(PID).%N" (screen ":pts/N:S.M", an X terminal ":0"), and tmux's pid is its
            server's. A login whose shell became a tmux *client* (`gpuctl attach`, `ssh -t host
            tmux attach`) is a person and counts.
          - stale records: the login's process is gone (or its pid now names a younger process),
            e.g. after sshd was killed without writing the logout.
          - quiet logins: no input on the terminal for `idle_s` (its access time, as `w` shows
            IDLE). sshd keeps a vanished laptop's connection open for hours without
            ClientAliveInterval; the guard cannot tell it from a user who stopped typing, and
            treats both alike.
        """
        counted, ignored = [], []
        path, records = read_utmp()
        for rec in records:
            entry = {"user": rec["user"], "line": rec["line"], "host": rec["host"], "pid": rec["pid"]}
            why = None
            comm = proc_comm(rec["pid"])
            if MULTIPLEXER_HOST.match(rec["host"]) or comm == "tmux: server":
                why = "tmux pane"
            elif not comm or process_younger_than(rec["pid"], rec["at"]):
                why = "process gone"
            else:
                try:
                    st = os.stat(os.path.join("/dev", rec["line"]))
                except (OSError, ValueError):
                    st = None
                if st is None or not stat.S_ISCHR(st.st_mode):
                    why = "no terminal"
                else:
                    last_input = min(now, (int(st.st_atime) // TTY_TIME_SLOT + 1) * TTY_TIME_SLOT)
                    entry["last_input"] = last_input
                    entry["quiet_s"] = round(now - last_input, 1)
                    if idle_s > 0 and now - last_input >= idle_s:
                        why = "no input for %.0fs" % (now - last_input)
            if why:
                entry["why"] = why
                ignored.append(entry)
            else:
                counted.append(entry)
        return path, counted, ignored

    # --- acting -------------------------------------------------------------------------------------

    def stop_jobs(self, cfg, running, grace_s):
        for name, run_dir, _, _ in running:
            res = self.tmux(cfg, "list-panes", "-t", "=%s:" % name, "-F", "#{pane_pid}")
            pid = res.stdout.strip().split("\n")[0] if res and res.returncode == 0 else ""
            if pid:
                sh(["kill", "-TERM", "--", "-" + pid])  # the pane leads its process group
        deadline = time.time() + grace_s
        while time.time() < deadline and any(
            not os.path.exists(os.path.join(run_dir, "exitcode")) for _, run_dir, _, _ in running
        ):
            time.sleep(0.5)
        for name, run_dir, _, _ in running:
            if not os.path.exists(os.path.join(run_dir, "exitcode")):
                res = self.tmux(cfg, "list-panes", "-t", "=%s:" % name, "-F", "#{pane_pid}")
                pid = res.stdout.strip().split("\n")[0] if res and res.returncode == 0 else ""
                if pid:
                    sh(["kill", "-KILL", "--", "-" + pid])
            self.tmux(cfg, "kill-session", "-t", "=" + name)

    def fire(self, cfg, reason, detail, running):
        action = cfg.get("on_fire") or "stop-jobs"
        log_line(self.guard_dir, "FIRE %s: %s -> %s" % (reason, detail, action))
        write_json(os.path.join(self.guard_dir, "fired.json"),
                   {"reason": reason, "detail": detail, "at": time.time(), "action": action})
        if running:
            self.stop_jobs(cfg, running, float(cfg.get("grace_s", 120)))
        if action == "poweroff":
            sh(["sh", "-c", cfg.get("poweroff_command", "sudo shutdown -h now")], timeout=120)

    # --- deciding -----------------------------------------------------------------------------------

    def tick(self):
        cfg = read_json(self.config_path)
        if not cfg:
            return
        now = time.time()
        runs = self.runs(cfg)
        running = [r for r in runs if r[2]]
        gpu = self.gpu_utilization()
        gpu_idle = gpu is None or gpu < float(cfg.get("gpu_idle_percent", 5))
        idle_s = float(cfg.get("idle_s", 0))
        utmp, counted, ignored = self.logins(now, idle_s)
        sessions = len(counted)
        spent = float(cfg.get("usd_per_hour", 0)) * max(0.0, now - float(cfg.get("started_at", now))) / 3600.0
        budget = float(cfg.get("budget_usd", 0))
        stall_s, grace_s = float(cfg.get("stall_s", 0)), float(cfg.get("grace_s", 120))
        fired = read_json(os.path.join(self.guard_dir, "fired.json"))
        state = {"at": now, "jobs": [r[0] for r in running], "gpu_util": gpu, "ssh_sessions": sessions,
                 "logins": {"utmp": utmp, "counted": counted, "ignored": ignored},
                 "spent_usd": spent, "budget_usd": budget, "idle_since": None, "fires_at": {}, "stalled": [],
                 "fired": fired, "pid": os.getpid(), "boot_id": self.boot_id, "cluster_key": cfg.get("cluster_key")}

        reason = detail = None
        # budget: the uptime's cost, whatever the jobs do
        if budget > 0:
            rate = float(cfg.get("usd_per_hour", 0))
            state["fires_at"]["budget"] = float(cfg.get("started_at", now)) + budget / rate * 3600.0 if rate > 0 else None
            if spent >= budget:
                reason, detail = "budget", "$%.4f spent of a $%.4f budget" % (spent, budget)
        # after the run
        armed_at = cfg.get("down_after_run_since")
        if reason is None and cfg.get("down_after_run") and armed_at is not None and not running:
            ended = [r[3] for r in runs if r[3] is not None and r[3] >= float(armed_at)]
            if ended and fired and fired.get("reason") == "run-done" and fired.get("at", 0) >= max(ended):
                ended = []  # fired for this run already
            if ended:
                state["fires_at"]["run-done"] = max(ended) + grace_s
                if now >= max(ended) + grace_s:
                    reason, detail = "run-done", "the run ended %.0fs ago" % (now - max(ended))
        # the hard cap, as the watchdog sees it (the boot-time timer is the one that needs no watchdog)
        cap = cfg.get("hard_cap_at")
        if cap:
            state["fires_at"]["hard-cap"] = float(cap)
            if reason is None and now >= float(cap):
                reason, detail = "hard-cap", "max_hours reached"
        # hung jobs
        for name, run_dir, _, _ in running:
            log_path = os.path.join(run_dir, "output.log")
            quiet = now - (os.path.getmtime(log_path) if os.path.exists(log_path) else now)
            if stall_s > 0 and gpu_idle and quiet >= stall_s:
                state["stalled"].append(name)
                if name not in self.warned:
                    log_line(self.guard_dir, "WARN stall: %s: GPU idle and log silent for %.0fs" % (name, quiet))
                    self.warned.add(name)
                if cfg.get("on_stall") == "fire" and reason is None:
                    reason, detail = "stall", "%s hung: GPU idle, log silent %.0fs" % (name, quiet)
        # idle: counted from the later of the first tick without a job or GPU work and the last
        # input on any login. A login keeps the instance busy until its terminal has been quiet for
        # `idle_s`; once it is gone (or quiet), its last input still counts, so idle fires `idle_s`
        # after the user's last keystroke, not `idle_s` after the guard noticed.
        if self.previous is not None:
            self.idle_since = inherited_idle_since(self.previous, cfg, self.boot_id)
            self.previous = None
        if not running and gpu_idle:
            if self.idle_since is None:
                self.idle_since = now
            for entry in counted:
                self.idle_since = max(self.idle_since, entry["last_input"])
            state["idle_since"] = self.idle_since
            if idle_s > 0:
                state["fires_at"]["idle"] = self.idle_since + idle_s
                if reason is None and not counted and now - self.idle_since >= idle_s:
                    reason, detail = "idle", "idle for %.0fs (no job, GPU %s, no interactive login%s)" % (
                        now - self.idle_since, "absent" if gpu is None else "%.0f%%" % gpu,
                        "; not counted: " + summarize(ignored) if ignored else "")
        else:
            self.idle_since = None

        log_line(self.guard_dir, "jobs=%d gpu=%s ssh=%d%s%s spent=$%.4f%s -> %s" % (
            len(running), "none" if gpu is None else "%.0f%%" % gpu, sessions,
            " (%s)" % ", ".join("%s@%s from %s, no input for %.0fs" % (e["user"], e["line"], e["host"] or "?", e["quiet_s"])
                                for e in counted) if counted else "",
            " [not counted: %s]" % summarize(ignored) if ignored else "" if utmp else " [no utmp: logins unseen]", spent,
            "" if budget <= 0 else "/$%.4f" % budget, "fire %s" % reason if reason else "ok"))
        write_json(os.path.join(self.guard_dir, "state.json"), state)
        if reason:
            self.fire(cfg, reason, detail, running)
            self.idle_since = None  # one firing per idle stretch
            state["fired"] = read_json(os.path.join(self.guard_dir, "fired.json"))
            state["idle_since"] = None
            write_json(os.path.join(self.guard_dir, "state.json"), state)

    def run_forever(self):
        log_line(self.guard_dir, "watchdog started (pid %d)" % os.getpid())
        while True:
            try:
                self.tick()
            except Exception as exc:  # a bad tick must not end the guard
                log_line(self.guard_dir, "ERROR %s: %s" % (type(exc).__name__, exc))
            cfg = read_json(self.config_path) or {}
            time.sleep(max(0.2, float(cfg.get("check_interval_s", 60))))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: gpuctl_watchdog.py GUARD_DIR/config.json\n")
        sys.exit(2)
    Watchdog(sys.argv[1]).run_forever()
