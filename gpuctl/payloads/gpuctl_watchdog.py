"""gpuctl's watchdog: runs on the instance and ends the spend by itself. Stdlib only; Python 3.8+.

Usage: python gpuctl_watchdog.py GUARD_DIR/config.json (gpuctl_guard_check.py: one dry look)

Every check interval it reloads its config (so `gpuctl guard set` applies at once), looks at the
jobs, the GPU and the interactive logins, decides, and appends the decision and its reasons to
decisions.log; state.json holds the latest picture for `gpuctl status`. Guards:
  idle      no gpuctl job, GPU under the threshold (or no GPU), no input on any interactive login
            (see logins()), no gpuctl command at work here (see busy()), for `idle_s`
  stall     a job lives, its GPU is idle and its log has not grown for `stall_s`: warn (or fire)
  budget    $/h x uptime reaches `budget_usd`: stop the jobs gracefully (SIGTERM, grace), then fire
  run-done  `down_after_run`: a run ended (success or failure) and `grace_s` passed
Firing means `on_fire`: "poweroff" runs `poweroff_command`; "stop-jobs" stops gpuctl's jobs only.
The job-stopping code repeats gpuctl.remote.jobs on purpose: this file runs alone on the instance.
"""

import hashlib
import json
import os
import subprocess
import sys
import time

import gpuctl_logins  # beside these files on the instance
import gpuctl_notice

WATCHDOG_SESSION = "gpuctl-watchdog"

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


def code_version():
    """Hash of this file and the two it imports, as gpuctl.ops.guards.code_version computes it: the
    client restarts a watchdog whose code is older than the one it pushed."""
    digest = hashlib.sha1()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("gpuctl_watchdog.py", "gpuctl_logins.py", "gpuctl_notice.py"):
        with open(os.path.join(here, name), "rb") as fh:
            digest.update(fh.read())
    return digest.hexdigest()[:12]


def entries(folder):
    """The names in a folder, sorted; none if it is missing or unreadable."""
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


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
        self.dry = False  # --check: look and decide, change nothing, fire nothing
        self.idle_fired = False  # idle fired in this idle stretch: not again until something happens
        self.code = code_version()

    def log(self, text):
        if not self.dry:
            log_line(self.guard_dir, text)

    # --- what is there ---------------------------------------------------------------------------

    def tmux(self, cfg, *args):
        return sh(["tmux", "-L", cfg["tmux_socket"]] + list(args))

    def runs(self, cfg):
        """[(run_id, run_dir, running, ended_at)] for every run gpuctl started on this host."""
        out = []
        runs_dir = cfg["runs_dir"]
        names = entries(runs_dir)
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
        if self.dry:
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
        self.log("run %s: its pane died without recording an exit code; tmux says %d"
                 % (os.path.basename(run_dir), code))

    def gpu_utilization(self):
        res = sh(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"])
        if res is None or res.returncode != 0:
            return None
        values = [float(v) for v in res.stdout.split() if v.replace(".", "", 1).isdigit()]
        return max(values) if values else None

    def logins(self, now, idle_s):
        """(utmp path or None, counted, ignored): gpuctl_logins.logins."""
        return gpuctl_logins.logins(now, idle_s)

    def busy(self, cfg, now):
        """Names of gpuctl commands at work on this host (gpuctl.remote.heartbeat): a file in
        busy/ whose mtime (this host's clock) is younger than `heartbeat_stale_s`. A stale one was
        left by a client that vanished mid-command: it is removed and counts no more."""
        out = []
        stale_s = float(cfg.get("heartbeat_stale_s", 20))
        folder = os.path.join(self.guard_dir, "busy")
        names = entries(folder)
        for name in names:
            path = os.path.join(folder, name)
            try:
                age = now - os.path.getmtime(path)
            except OSError:
                continue  # its command just ended
            if age < stale_s:
                out.append(name)
            elif not self.dry:
                self.log("gpuctl command %s: no heartbeat for %.0fs, no longer counted" % (name, age))
                try:
                    os.remove(path)
                except OSError:
                    pass
        return out

    def pane_pid(self, cfg, name):
        res = self.tmux(cfg, "list-panes", "-t", "=%s:" % name, "-F", "#{pane_pid}")
        return res.stdout.strip().split("\n")[0] if res and res.returncode == 0 else ""

    def signal_jobs(self, cfg, running, signal):
        for name, _, _, _ in running:
            pid = self.pane_pid(cfg, name)
            if pid:
                sh(["kill", "-" + signal, "--", "-" + pid])  # the pane leads its process group

    def stop_jobs(self, cfg, running, grace_s):
        self.signal_jobs(cfg, running, "TERM")
        deadline = time.time() + grace_s
        while time.time() < deadline and any(
            not os.path.exists(os.path.join(run_dir, "exitcode")) for _, run_dir, _, _ in running
        ):
            time.sleep(0.5)
        for name, run_dir, _, _ in running:
            if not os.path.exists(os.path.join(run_dir, "exitcode")):
                self.signal_jobs(cfg, [(name, run_dir, True, None)], "KILL")
            self.tmux(cfg, "kill-session", "-t", "=" + name)

    def neighbours_at_work(self, now):
        """Other gpuctl clusters on this host (an ssh host shared by several: sibling work dirs)
        whose watchdogs saw a job in the last few minutes: their work is not this cluster's to end."""
        root = os.path.dirname(self.guard_dir)
        parent = os.path.dirname(root)
        out = []
        names = entries(parent)
        for name in names:
            if os.path.join(parent, name) == root:
                continue
            st = read_json(os.path.join(parent, name, "guard", "state.json"))
            try:
                if isinstance(st, dict) and st.get("jobs") and now - float(st.get("at") or 0) < 180:
                    out.append(name)
            except (TypeError, ValueError):
                continue  # not a state this watchdog can read: it must not stop the firing
        return out

    def fire(self, cfg, reason, detail, running):
        action = cfg.get("on_fire") or "stop-jobs"
        if action == "poweroff" and os.path.exists(os.path.join(self.guard_dir, gpuctl_notice.NOTICE_FILE)):
            # EC2 ends this spot instance within two minutes, and bills none of its first hour
            # then; powering it off ourselves would be billed.
            self.log("poweroff held back: a spot interruption notice came; EC2 ends the instance")
            action = "stop-jobs"
        if action == "poweroff":
            neighbours = self.neighbours_at_work(time.time())
            if neighbours:
                self.log("poweroff held back: cluster(s) %s on this host run jobs" % ", ".join(neighbours))
                action = "stop-jobs"
        self.log("FIRE %s: %s -> %s" % (reason, detail, action))
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
        busy = self.busy(cfg, now)
        sessions = len(counted)
        spent = float(cfg.get("usd_per_hour", 0)) * max(0.0, now - float(cfg.get("started_at", now))) / 3600.0
        budget = float(cfg.get("budget_usd", 0))
        stall_s, grace_s = float(cfg.get("stall_s", 0)), float(cfg.get("grace_s", 120))
        fired = read_json(os.path.join(self.guard_dir, "fired.json"))
        state = {"at": now, "jobs": [r[0] for r in running], "gpu_util": gpu, "ssh_sessions": sessions,
                 "logins": {"utmp": utmp, "counted": counted, "ignored": ignored},
                 "busy": busy, "spent_usd": spent, "budget_usd": budget, "idle_since": None, "fires_at": {}, "stalled": [],
                 "fired": fired, "pid": os.getpid(), "code": self.code, "boot_id": self.boot_id, "cluster_key": cfg.get("cluster_key")}

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
                    self.log("WARN stall: %s: GPU idle and log silent for %.0fs" % (name, quiet))
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
        if running or busy or counted or not gpu_idle:
            self.idle_fired = False
        if not running and gpu_idle and not busy:
            if self.idle_since is None:
                self.idle_since = now
            for entry in counted:
                self.idle_since = max(self.idle_since, entry["last_input"])
            state["idle_since"] = self.idle_since
            if idle_s > 0 and not self.idle_fired:
                state["fires_at"]["idle"] = self.idle_since + idle_s
                if reason is None and not counted and not self.idle_fired and now - self.idle_since >= idle_s:
                    reason, detail = "idle", "idle for %.0fs (no job, GPU %s, no interactive login%s)" % (
                        now - self.idle_since, "absent" if gpu is None else "%.0f%%" % gpu,
                        "; not counted: " + gpuctl_logins.summarize(ignored) if ignored else "")
        else:
            self.idle_since = None

        self.log("jobs=%d gpu=%s ssh=%d%s%s%s spent=$%.4f%s -> %s" % (
            len(running), "none" if gpu is None else "%.0f%%" % gpu, sessions,
            " (%s)" % ", ".join("%s@%s from %s, no input for %.0fs" % (e["user"], e["line"], e["host"] or "?", e["quiet_s"])
                                for e in counted) if counted else "",
            " [not counted: %s]" % gpuctl_logins.summarize(ignored) if ignored else "" if utmp else " [no utmp: logins unseen]",
            " gpuctl at work: %s" % ", ".join(busy) if busy else "", spent,
            "" if budget <= 0 else "/$%.4f" % budget, "fire %s" % reason if reason else "ok"))
        if self.dry:
            return state, reason, detail
        write_json(os.path.join(self.guard_dir, "state.json"), state)
        if reason:
            self.fire(cfg, reason, detail, running)
            self.idle_fired = self.idle_fired or reason == "idle"  # one firing per idle stretch
            state["fired"] = read_json(os.path.join(self.guard_dir, "fired.json"))
            state["idle_since"] = None
            write_json(os.path.join(self.guard_dir, "state.json"), state)
        return state, reason, detail

    def nap(self, since):
        """Until the check interval in force has passed since `since`: the config is read again
        every second, so a `guard set --check-interval 1s` applies within a second, not after
        the rest of a 60 s sleep."""
        while True:
            cfg = read_json(self.config_path) or {}
            try:
                interval = max(0.2, float(cfg.get("check_interval_s", 60)))
            except (TypeError, ValueError):
                interval = 60.0
            left = since + interval - time.time()
            if left <= 0:
                return
            time.sleep(min(left, 1.0))

    def run_forever(self):
        self.log("watchdog started (pid %d)" % os.getpid())
        gpuctl_notice.start(self, read_json, write_json)  # polled every 5 s in a thread, whatever the check interval
        while True:
            since = time.time()
            try:
                self.tick()
            except Exception as exc:  # a bad tick must not end the guard
                self.log("ERROR %s: %s" % (type(exc).__name__, exc))
            self.nap(since)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: gpuctl_watchdog.py GUARD_DIR/config.json\n")
        sys.exit(2)
    Watchdog(sys.argv[1]).run_forever()
