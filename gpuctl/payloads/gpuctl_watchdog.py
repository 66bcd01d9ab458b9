"""gpuctl's watchdog: runs on the instance and ends the spend by itself. Stdlib only; Python 3.8+.

Usage: python gpuctl_watchdog.py GUARD_DIR/config.json (gpuctl_guard_check.py: one dry look)

Every check interval it reloads its config (so `gpuctl guard set` applies at once), looks at the
jobs, the GPU and the interactive logins, decides, and appends the decision and its reasons to
decisions.log; state.json holds the latest picture for `gpuctl status`. The guards, and which
fires first: gpuctl_decide.py. Firing means `on_fire`: "poweroff" runs `poweroff_command`; "stop-jobs" stops gpuctl's jobs only.
The config is a gpuctl_protocol.GuardConfig: a key it lacks, or a bad value, takes its default (a
deadline there but unreadable takes one long past, so its guard fires).
The job-stopping code repeats gpuctl.remote.jobs on purpose: this file runs alone on the instance.
"""

import hashlib
import json
import os
import subprocess
import sys
import time

import gpuctl_decide  # beside these files on the instance
import gpuctl_logins
import gpuctl_nbwatch
import gpuctl_notice
import gpuctl_protocol
from gpuctl_decide import Observation, Run

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
    """Hash of this file and those it imports, as gpuctl.ops.guards.code_version computes it: the
    client restarts a watchdog whose code is older than the one it pushed."""
    digest = hashlib.sha1()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in gpuctl_protocol.WATCHDOG_FILES:
        with open(os.path.join(here, name), "rb") as fh:
            digest.update(fh.read())
    return digest.hexdigest()[:12]


def entries(folder):
    """The names in a folder, sorted; none if it is missing or unreadable."""
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def mtime(path):
    """The file's mtime (this host's clock), None if it is missing."""
    try:
        return os.path.getmtime(path)
    except OSError:
        return None


def boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return None


class Watchdog(object):
    def __init__(self, config_path):
        self.config_path = config_path
        self.guard_dir = os.path.dirname(os.path.abspath(config_path))
        # A revived watchdog keeps counting idle time from where the last one left off, but only
        # if that one watched this cluster in this boot (checked on the first tick, with the config).
        self.previous = read_json(os.path.join(self.guard_dir, "state.json"), {}) or {}
        self.boot_id = boot_id()
        self.memory = gpuctl_decide.FRESH
        self.dry = False  # --check: look and decide, change nothing, fire nothing
        self.code = code_version()

    def log(self, text):
        if not self.dry:
            log_line(self.guard_dir, text)

    def config(self):
        """The config as it is now (gpuctl guard set rewrites it); None when there is none."""
        data = read_json(self.config_path)
        return gpuctl_protocol.GuardConfig.from_dict(data) if data else None

    # --- what is there ---------------------------------------------------------------------------

    def tmux(self, cfg, *args):
        return sh(["tmux", "-L", cfg.tmux_socket] + list(args))

    def runs(self, cfg):
        """[Run] for every run gpuctl started on this host."""
        out = []
        runs_dir = cfg.runs_dir
        for name in entries(runs_dir):
            run_dir = os.path.join(runs_dir, name)
            if not os.path.isfile(os.path.join(run_dir, "job.sh")):
                continue
            code_path = os.path.join(run_dir, gpuctl_protocol.EXIT_CODE_FILE)
            pane = None if os.path.exists(code_path) else self.pane(cfg, name)  # pane first, then the file
            if pane is not None and pane["dead"] and not os.path.exists(code_path):
                self.record_exit(run_dir, pane)
            if os.path.exists(code_path):
                out.append(Run(name, False, mtime(code_path), False, None))
                continue
            # A dead pane is over even when its exit code is unknown: remain-on-exit keeps it (and
            # its session) after the job ends, so the session's existence alone proves nothing.
            running = bool(pane is not None and not pane["dead"])
            # A run waiting in the cluster's queue (payloads/gpuctl_queue.py) is work, as a job is
            # (its pane lives), but neither hung nor stalled: it has not started.
            queued = running and (read_json(os.path.join(run_dir, gpuctl_protocol.QUEUE_FILE)) or {}).get("state") == "queued"
            peers = os.path.exists(os.path.join(run_dir, gpuctl_protocol.NODE_STARTED_FILE))  # one node of several
            out.append(Run(name, running, None, queued, mtime(os.path.join(run_dir, "output.log")), peers))
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
        tmp = os.path.join(run_dir, gpuctl_protocol.EXIT_CODE_FILE + ".watchdog.tmp")
        with open(tmp, "w") as fh:
            fh.write("%d\n" % code)
        os.replace(tmp, os.path.join(run_dir, gpuctl_protocol.EXIT_CODE_FILE))
        self.log("run %s: its pane died without recording an exit code; tmux says %d"
                 % (os.path.basename(run_dir), code))

    def gpu_utilization(self):
        # A healthy nvidia-smi answers within seconds; a hung one must not stall every look (and
        # `train`'s wait for the first one) for 30 s: then the GPU's use is unknown this look.
        res = sh(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"], timeout=gpuctl_protocol.NVIDIA_SMI_S)
        if res is None or res.returncode != 0:
            return None
        values = [float(v) for v in res.stdout.split() if v.replace(".", "", 1).isdigit()]
        return max(values) if values else None

    def logins(self, now, idle_s):
        """(utmp path or None, counted, ignored): gpuctl_logins.logins."""
        return gpuctl_logins.logins(now, idle_s)

    def heartbeats(self):
        """{name: mtime (this host's clock)} of the busy files of gpuctl commands at work here
        (gpuctl.remote.heartbeat); gpuctl_decide.heartbeats says which still count."""
        folder = os.path.join(self.guard_dir, "busy")
        beats = {}
        for name in entries(folder):
            at = mtime(os.path.join(folder, name))
            if at is not None:  # else its command just ended
                beats[name] = at
        return beats

    def neighbours(self):
        """{cluster: (jobs, at)} of the other gpuctl clusters on this host (an ssh host shared by
        several: sibling work dirs), as their watchdogs last recorded them."""
        root = os.path.dirname(self.guard_dir)
        parent = os.path.dirname(root)
        out = {}
        for name in entries(parent):
            if os.path.join(parent, name) == root:
                continue
            st = read_json(os.path.join(parent, name, "guard", "state.json"))
            if isinstance(st, dict):
                out[name] = (st.get("jobs"), st.get("at"))
        return out

    def observe(self, cfg, now):
        """Everything one tick looks at: the runs, the GPU, the logins, gpuctl's heartbeats, the
        last firing, a spot notice, the neighbours."""
        return Observation(
            runs=self.runs(cfg), gpu=self.gpu_utilization(),
            logins=self.logins(now, cfg.idle_s), heartbeats=self.heartbeats(),
            fired=read_json(os.path.join(self.guard_dir, "fired.json")),
            notice=os.path.exists(os.path.join(self.guard_dir, gpuctl_protocol.NOTICE_FILE)),
            neighbours=self.neighbours(), notebook=gpuctl_nbwatch.look(cfg.runs_dir) if cfg.runs_dir else None)

    # --- doing ---------------------------------------------------------------------------------------

    def pane_pid(self, cfg, name):
        res = self.tmux(cfg, "list-panes", "-t", "=%s:" % name, "-F", "#{pane_pid}")
        return res.stdout.strip().split("\n")[0] if res and res.returncode == 0 else ""

    def signal_jobs(self, cfg, names, signal):
        for name in names:
            pid = self.pane_pid(cfg, name)
            if pid:
                sh(["kill", "-" + signal, "--", "-" + pid])  # the pane leads its process group

    def stop_jobs(self, cfg, names, grace_s):
        self.signal_jobs(cfg, names, "TERM")
        codes = dict((name, os.path.join(cfg.runs_dir, name, gpuctl_protocol.EXIT_CODE_FILE)) for name in names)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(not os.path.exists(c) for c in codes.values()):
            time.sleep(0.5)
        for name, code in sorted(codes.items()):
            if not os.path.exists(code):
                self.signal_jobs(cfg, [name], "KILL")
            self.tmux(cfg, "kill-session", "-t", "=" + name)

    def stop_notebook(self, cfg):
        """SIGTERM the notebook server (its tmux session is named as its folder), SIGKILL after
        the grace: a Jupyter can hang in its shutdown. Its kernels end with it (ipykernel watches
        its parent)."""
        name = gpuctl_nbwatch.NOTEBOOK_DIR
        code = os.path.join(gpuctl_nbwatch.notebook_dir(cfg.runs_dir), "exitcode")
        self.signal_jobs(cfg, [name], "TERM")
        deadline = time.time() + cfg.grace_s
        while time.time() < deadline and not os.path.exists(code):
            time.sleep(0.5)
        if not os.path.exists(code):
            self.signal_jobs(cfg, [name], "KILL")

    def fire(self, cfg, decision):
        self.log("FIRE %s: %s -> %s" % (decision.reason, decision.detail, decision.action))
        write_json(os.path.join(self.guard_dir, "fired.json"), {"reason": decision.reason, "detail": decision.detail,
                                                                 "at": time.time(), "action": decision.action})
        if decision.state["jobs"]:
            self.stop_jobs(cfg, decision.state["jobs"], cfg.grace_s)
        if cfg.runs_dir and gpuctl_nbwatch.running(gpuctl_nbwatch.notebook_dir(cfg.runs_dir)) is not None:
            self.stop_notebook(cfg)
        if decision.action == gpuctl_protocol.POWEROFF:
            sh(["sh", "-c", cfg.poweroff_command], timeout=120)

    # --- one tick --------------------------------------------------------------------------------------

    def tick(self):
        """Observe, decide (gpuctl_decide), act; (state, reason, detail)."""
        cfg = self.config()
        if cfg is None:
            return
        now = time.time()
        if self.previous is not None:  # the first tick: the idle time a previous watchdog counted
            self.memory = self.memory._replace(
                idle_since=gpuctl_decide.inherited_idle_since(self.previous, cfg, self.boot_id))
            self.previous = None
        seen = self.observe(cfg, now)
        decision = gpuctl_decide.decide(cfg, seen, now, self.memory)
        self.memory = decision.memory
        utmp, counted, ignored = seen.logins
        state = dict(decision.state, at=now, gpu_util=seen.gpu, ssh_sessions=len(counted),
                     logins={"utmp": utmp, "counted": counted, "ignored": ignored}, fired=seen.fired,
                     pid=os.getpid(), code=self.code, boot_id=self.boot_id, cluster_key=cfg.cluster_key)
        for note in decision.notes:
            self.log(note)
        self.log("jobs=%d gpu=%s ssh=%d%s%s%s%s spent=$%.4f%s -> %s" % (
            len(state["jobs"]), "none" if seen.gpu is None else "%.0f%%" % seen.gpu, len(counted),
            " (%s)" % ", ".join("%s@%s from %s, no input for %.0fs" % (e["user"], e["line"], e["host"] or "?", e["quiet_s"])
                                for e in counted) if counted else "",
            " [not counted: %s]" % gpuctl_logins.summarize(ignored) if ignored else "" if utmp else " [no utmp: logins unseen]",
            " gpuctl at work: %s" % ", ".join(state["busy"]) if state["busy"] else "",
            " notebook: %d kernel(s), %d busy" % (seen.notebook["kernels"], seen.notebook["busy"]) if seen.notebook else "",
            state["spent_usd"],
            "" if state["budget_usd"] <= 0 else "/$%.4f" % state["budget_usd"],
            "fire %s" % decision.reason if decision.reason else "ok"))
        if self.dry:
            return state, decision.reason, decision.detail
        for name in decision.forget:  # stale heartbeats: their clients vanished mid-command
            try:
                os.remove(os.path.join(self.guard_dir, "busy", name))
            except OSError:
                pass
        write_json(os.path.join(self.guard_dir, "state.json"), state)
        if decision.reason:
            self.fire(cfg, decision)
            state["fired"] = read_json(os.path.join(self.guard_dir, "fired.json"))
            state["idle_since"] = None
            write_json(os.path.join(self.guard_dir, "state.json"), state)
        return state, decision.reason, decision.detail

    def nap(self, since):
        """Until the check interval in force has passed since `since`: the config is read again
        every second, so a `guard set --check-interval 1s` applies within a second, not after
        the rest of a 60 s sleep."""
        while True:
            interval = max(0.2, (self.config() or gpuctl_protocol.GuardConfig()).check_interval_s)
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
