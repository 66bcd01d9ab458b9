"""The cluster's run queue, driven on the instance (a closed laptop never stalls it). Stdlib only.

Usage:
  python gpuctl_queue.py RUN_DIR/run.json LAUNCHER [ARGS...]   wait for the run's turn, then run LAUNCHER
  python gpuctl_queue.py dequeue QUEUE_DIR RUN_ID                remove a queued run (prints yes/no)
  python gpuctl_queue.py close QUEUE_DIR                         runs queued until now never start (down)

QUEUE_DIR holds one JSON file per run not yet over, named by its order of arrival, changed only
under an flock on QUEUE_DIR/.lock. A run asks for `want` of the node's `slots` (its GPUs; one on a
node without GPU) and starts when that many are free and no run that arrived before it waits:
strict order, no run jumps a bigger one. `now` (train --now) starts at once: on free GPUs when
there are enough (it holds them), else beside the others on theirs (it holds none). A run holds
its slots until its process (this one, which then runs the launcher: same pid) is gone.

Each run's RUN_DIR/queue.json says where it is: queued (position), running (slots, share), or
dequeued/cancelled. `share` = slots held / slots of the node: the part of the node's rate the run
pays, so runs together never pay more than the node.
"""

import builtins
import fcntl
import json
import os
import sys
import time
import types
from typing import Set

from gpuctl_protocol import NODE_STARTED_FILE, QUEUE_FILE, STOPPED_EXIT, RunConfig  # beside this file on the instance

POLL_S = 0.5
MAX_ENTRY = 65536


def _write(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def _write_text(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _read(path):
    """The JSON object in a file, or None (unreadable, a directory, not an object, over MAX_ENTRY)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_ENTRY + 1)
        data = json.loads(raw.decode("utf-8")) if len(raw) <= MAX_ENTRY else None
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


class Locked(object):
    def __init__(self, qdir):
        os.makedirs(qdir, mode=0o700, exist_ok=True)
        self.fd = os.open(os.path.join(qdir, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def alive(pid):
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def _int(value, low, high):
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def problem(e):
    """Why a queue entry is not one this queue can weigh (None: it is). Another process wrote it
    (a run of an older or newer gpuctl, a hand, a fault), so nothing in it is taken on trust."""
    if not isinstance(e, dict):
        return "not a JSON object of at most %d bytes" % MAX_ENTRY
    if not _int(e.get("pid"), 1, (1 << 31) - 1):  # 0 or -1 would ask for a whole group of processes
        return "no pid"
    if not _int(e.get("seq"), 0, 10 ** 15):
        return "no seq"
    if e.get("state") not in ("queued", "running"):
        return "no state"
    if not _int(e.get("want"), 1, 1 << 16):
        return "no want"
    held = e.get("held", [])
    if not (isinstance(held, list) and len(held) <= 1 << 16 and all(_int(i, 0, 1 << 16) for i in held)):
        return "held is not a list of slots"
    if not isinstance(e.get("now", False), bool):
        return "now is not true or false"
    return None


def shown(name):
    """A file name as a log line may show it: no control character reaches a terminal."""
    text = name if len(name) <= 120 else name[:120] + "..."
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def entries(qdir, said=None):
    """The runs in the queue, in order of arrival; those whose process is gone are removed. An
    entry that is no queue entry (not JSON, fields missing or of the wrong kind) is skipped, never
    fatal to the others, and named once on stderr (the run's log) when `said` (the names already
    named) is given; it is left where it is, unless its own process is gone."""
    out = []
    for name in sorted(os.listdir(qdir)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(qdir, name)
        e = _read(path)
        why = problem(e)
        gone = isinstance(e, dict) and _int(e.get("pid"), 1, (1 << 31) - 1) and not alive(e["pid"])
        if gone:
            try:
                os.remove(path)
            except OSError:
                pass
            continue
        if why is not None:
            if said is not None and name not in said:
                said.add(name)
                sys.stderr.write("gpuctl: queue entry %s skipped: %s\n" % (shown(name), why))
                sys.stderr.flush()
            continue
        e["_path"] = path
        out.append(e)
    return out


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th...: a queued run's place, as `gpuctl status` and `train` say it."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return "%d%s" % (n, suffix)


def waiting_for(want, slots, gpus):
    """What a queued run waits for: GPUs, or on a node without GPU its one slot."""
    if gpus <= 0:
        return "the node's one slot (no GPU there: its runs go one at a time)"
    return "%d of the node's %d GPU(s)" % (want, slots)


def position(queue, me):
    """1 = next to start."""
    return 1 + sum(1 for e in queue if e["state"] == "queued" and e["seq"] < me["seq"] and not e.get("now"))


def decide(queue, me, slots):
    """(held, visible) when the run may start now, else None."""
    held: Set[int] = set()
    for e in queue:
        if e["state"] == "running":
            held.update(e.get("held") or [])
    free = [i for i in range(slots) if i not in held]
    want = me["want"]
    if me.get("now"):
        if len(free) >= want:
            return free[:want], free[:want]
        return [], list(range(want))
    if position(queue, me) == 1 and len(free) >= want:
        return free[:want], free[:want]
    return None


def closed_since(qdir):
    try:
        return os.path.getmtime(os.path.join(qdir, "closed"))
    except OSError:
        return None


def wait_turn(cfg, run_dir, poll_s=POLL_S):
    """Queue the run (cfg: a RunConfig with its queue) and wait for its turn; its slots to use, or
    None when it was removed."""
    q = cfg.queue
    qdir, slots, want = q.dir, q.slots, q.want
    status = os.path.join(run_dir, QUEUE_FILE)
    with Locked(qdir):
        seq = max([int(n.split("-")[0]) for n in os.listdir(qdir) if n.endswith(".json") and n.split("-")[0].isdigit()]
                  or [0])
        me = {"run_id": cfg.run_id, "seq": seq + 1, "want": want, "now": q.now,
              "pid": os.getpid(), "queued_at": time.time(), "state": "queued"}
        path = os.path.join(qdir, "%012d-%s.json" % (me["seq"], cfg.run_id))
        _write(path, me)
    last = None
    said: Set[str] = set()  # the queue entries this run skipped and named: once each
    while True:
        with Locked(qdir):
            closed = closed_since(qdir)
            if not os.path.exists(path) or (closed is not None and closed >= me["queued_at"]):
                if os.path.exists(path):
                    os.remove(path)
                _write(status, dict(me, state="dequeued" if closed is None else "cancelled", ended_at=time.time()))
                return None
            queue = entries(qdir, said)
            got = decide(queue, me, slots)
            if got is not None:
                held, visible = got
                me.update(state="running", held=held, visible=visible, started_at=time.time(),
                          share=float(len(held)) / slots)
                _write(path, me)
                _write(status, me)
                return visible
            pos = position(queue, me)
        if pos != last:
            _write(status, dict(me, position=pos))
            if last is None:
                sys.stderr.write("gpuctl: queued (%s): waiting for %s\n"
                                 % (ordinal(pos), waiting_for(want, slots, q.gpus)))
                sys.stderr.flush()
            last = pos
        time.sleep(poll_s)


def run(argv):
    config, launcher, args = argv[0], argv[1], argv[2:]
    run_dir = os.path.dirname(os.path.abspath(config))
    with open(config) as fh:
        raw = json.load(fh)  # rewritten below with every key it has: a newer client's too
    cfg = RunConfig.from_dict(raw)
    if cfg.queue is not None:
        visible = wait_turn(cfg, run_dir)
        now = "%.6f\n" % time.time()
        with open(os.path.join(run_dir, "started"), "w") as fh:
            fh.write(now)  # how long it ran counts from here: its wait in the queue is not its time
        if visible is None:
            sys.stderr.write("gpuctl: removed from the queue before it started\n")
            return STOPPED_EXIT  # as a stopped run: the job script records it, gpuctl reads "stopped"
        place = _read(os.path.join(run_dir, QUEUE_FILE)) or {}
        share = place.get("share", 1.0)
        # A line in its log as it starts: its log grows again (the stall guard counts from here).
        sys.stderr.write("gpuctl: starting after %.0fs in the queue, on slot(s) %s\n" % (
            place.get("started_at", 0) - place.get("queued_at", 0), ",".join(str(i) for i in visible) or "-"))
        sys.stderr.flush()
        # Its epochs cost its share of the node's rate (the reports are computed here, from run.json).
        node_rate = cfg.queue.node_usd_per_hour
        raw["usd_per_hour"] = (cfg.usd_per_hour if node_rate is None else node_rate) * share
        _write(config, raw)
        if cfg.queue.gpus > 0:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in visible)
    if os.environ.get("GPUCTL_NUM_NODES", "1") != "1":
        # Which node's job started here: gpuctl reads it back on each node (a node that reads
        # another rank shares this directory with that node).
        _write_text(os.path.join(run_dir, NODE_STARTED_FILE), os.environ.get("GPUCTL_NODE_RANK", "") + "\n")
    sys.stdout.flush()
    run_as_main(launcher, [config] + list(args))
    return 0


def run_as_main(path, args):
    """Run the script at `path` in this process as `python PATH ARGS...` would: a new __main__
    module for good (nothing restored afterwards, as runpy would restore argv[0] and __main__
    before atexit handlers run), its argv, its directory first on sys.path. The queue exec'd the
    launcher before: a second interpreter's start, ~40 ms of every run. The run's slots stay held
    by this pid; the queue holds no lock, file or signal handler by now. (`ps` shows this file's
    command line for the whole run.)"""
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins  # type: ignore[attr-defined]  # a module's own, which typeshed does not list
    sys.argv = [path] + list(args)
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    sys.modules["__main__"] = main
    with open(path, "rb") as fh:
        code = compile(fh.read(), path, "exec")
    exec(code, main.__dict__)


def dequeue(qdir, run_id):
    """Remove a run that waits; True when it waited (its process then exits, as stopped)."""
    if not os.path.isdir(qdir):
        return False
    with Locked(qdir):
        for e in entries(qdir):
            if e.get("run_id") == run_id and e["state"] == "queued":
                os.remove(e["_path"])
                return True
    return False


def close(qdir):
    """The cluster is going down: no run queued until now starts."""
    with Locked(qdir):
        with open(os.path.join(qdir, "closed"), "w") as fh:
            fh.write("%.6f\n" % time.time())


def main(argv):
    if argv[:1] == ["dequeue"] and len(argv) == 3:
        print("yes" if dequeue(argv[1], argv[2]) else "no")
        return 0
    if argv[:1] == ["close"] and len(argv) == 2:
        close(argv[1])
        return 0
    if len(argv) >= 2:
        return run(argv)
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
