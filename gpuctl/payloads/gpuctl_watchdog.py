"""gpuctl's watchdog: runs on the instance and ends the spend by itself. Stdlib only; Python 3.8+.

Usage: python gpuctl_watchdog.py GUARD_DIR/config.json

Every check interval it reloads its config (so `gpuctl guard set` applies at once), looks at the
jobs, the GPU and the SSH sessions, decides, and appends the decision and its reasons to
decisions.log; state.json holds the latest picture for `gpuctl status`. Guards:
  idle      no gpuctl job, GPU under the threshold (or no GPU), no interactive SSH session, for `idle_s`
  stall     a job lives, its GPU is idle and its log has not grown for `stall_s`: warn (or fire)
  budget    $/h x uptime reaches `budget_usd`: stop the jobs gracefully (SIGTERM, grace), then fire
  run-done  `down_after_run`: a run ended (success or failure) and `grace_s` passed
Firing means `on_fire`: "poweroff" runs `poweroff_command`; "stop-jobs" stops gpuctl's jobs only.
The job-stopping code repeats gpuctl.remote.jobs on purpose: this file runs alone on the instance.
"""

import json
import os
import subprocess
import sys
import time

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


class Watchdog(object):
    def __init__(self, config_path):
        self.config_path = config_path
        self.guard_dir = os.path.dirname(os.path.abspath(config_path))
        state = read_json(os.path.join(self.guard_dir, "state.json"), {}) or {}
        # A revived watchdog keeps counting idle time from where the last one left off.
        self.idle_since = state.get("idle_since")
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
            if os.path.exists(code_path):
                out.append((name, run_dir, False, os.path.getmtime(code_path)))
                continue
            res = self.tmux(cfg, "has-session", "-t", "=" + name)
            out.append((name, run_dir, bool(res and res.returncode == 0), None))
        return out

    def gpu_utilization(self):
        res = sh(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"])
        if res is None or res.returncode != 0:
            return None
        values = [float(v) for v in res.stdout.split() if v.replace(".", "", 1).isdigit()]
        return max(values) if values else None

    def ssh_sessions(self):
        """Interactive logins (a terminal): gpuctl's own commands have none and do not count."""
        res = sh(["who"])
        if res is None or res.returncode != 0:
            return 0
        return len([line for line in res.stdout.splitlines() if line.strip()])

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
        sessions = self.ssh_sessions()
        spent = float(cfg.get("usd_per_hour", 0)) * max(0.0, now - float(cfg.get("started_at", now))) / 3600.0
        budget = float(cfg.get("budget_usd", 0))
        idle_s, stall_s, grace_s = float(cfg.get("idle_s", 0)), float(cfg.get("stall_s", 0)), float(cfg.get("grace_s", 120))
        fired = read_json(os.path.join(self.guard_dir, "fired.json"))
        state = {"at": now, "jobs": [r[0] for r in running], "gpu_util": gpu, "ssh_sessions": sessions,
                 "spent_usd": spent, "budget_usd": budget, "idle_since": None, "fires_at": {}, "stalled": [],
                 "fired": fired, "pid": os.getpid()}

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
        # idle
        idle_now = not running and gpu_idle and sessions == 0
        if idle_now:
            if self.idle_since is None:
                self.idle_since = now
            state["idle_since"] = self.idle_since
            if idle_s > 0:
                state["fires_at"]["idle"] = self.idle_since + idle_s
                if reason is None and now - self.idle_since >= idle_s:
                    reason, detail = "idle", "idle for %.0fs (no job, GPU %s, no SSH session)" % (
                        now - self.idle_since, "absent" if gpu is None else "%.0f%%" % gpu)
        else:
            self.idle_since = None

        log_line(self.guard_dir, "jobs=%d gpu=%s ssh=%d spent=$%.4f%s -> %s" % (
            len(running), "none" if gpu is None else "%.0f%%" % gpu, sessions, spent,
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
