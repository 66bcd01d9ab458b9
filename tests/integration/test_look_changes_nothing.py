"""A look changes nothing: every look command (`status`, `cost`, `logs`, `guard show`, their JSON
and other variants), run over and over against local clusters in every state, leaves the instance
side exactly as it was: every file and directory under the gpuctl home but the ledger (the local
provider's instances live there: `clusters/NAME/`, a node's `nodes/N/`, kept runs), with its size,
mtime and mode; every tmux session with its pane's pid and life; every process carrying a
cluster's mark. Only the ledger may learn what was seen.

Real parts: the local provider, real tmux, real jobs (a script that sleeps), a multi-node run one
of whose nodes was SIGKILLed (its chief then waits for it: the look that used to stop it), a node
that did not start as itself past the start deadline, and a tmux that only sleeps on PATH (every
host then does not answer)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.test_deadlines import SLEEPER as HUNG_TMUX
from tests.integration.test_deadlines import marked, wait_for

SLEEPER = "import time\nprint('working', flush=True)\ntime.sleep(600)\n"
QUICK = "print('done', flush=True)\n"
FAILS = "import sys\nprint('bad', flush=True)\nsys.exit(3)\n"
COMMAND_S = 2

LOOKS = [("status",), ("status", "--json"), ("status", "--all"), ("status", "--all", "--json"),
         ("cost",), ("cost", "--json"), ("cost", "--csv"), ("logs",)]
PER_CLUSTER = [("guard", "show", "--cluster", "{c}"), ("guard", "show", "--json", "--cluster", "{c}"),
               ("guard", "show", "--check", "--json", "--cluster", "{c}"), ("status", "--cluster", "{c}")]
PER_RUN = [("status", "{r}"), ("status", "{r}", "--json"), ("cost", "{r}"), ("cost", "{r}", "--json"),
           ("logs", "{r}"), ("logs", "{r}", "--raw")]
PER_NODE_RUN = [("logs", "{r}", "--node", "1")]


def _hosts(home: Path) -> list:
    from gpuctl.remote.local import LocalHost

    clusters = home / "clusters"
    return [LocalHost(root) for root in (*clusters.glob("*/nodes/*"), *clusters.glob("*"))
            if (root / "runs").is_dir() or root.parent.name == "nodes"]


def instance_side(home: Path) -> dict:
    """Everything of the instances a command could change: files (all but the ledger's), tmux
    panes, marked processes."""
    from gpuctl.remote import tmux

    files = {}
    for path in sorted(home.rglob("*")):
        rel = str(path.relative_to(home))
        if rel.startswith("ledger"):
            continue  # the one thing a look may write
        st = path.lstat()
        files[rel] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                      st.st_mtime_ns)
    panes, procs = {}, {}
    for host in _hosts(home):
        res = subprocess.run(tmux.argv(host, "list-panes", "-a", "-F", "#{session_name}|#{pane_pid}|#{pane_dead}"),
                             capture_output=True, text=True, timeout=10)
        panes[host.root] = sorted(res.stdout.splitlines())
        for pid in marked(host.tmux_socket):
            try:
                procs[pid] = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[19]  # its start time
            except OSError:
                continue
    return {"files": files, "panes": panes, "processes": procs}


def diff(before: dict, after: dict) -> list[str]:
    out = []
    for part in before:
        a, b = before[part], after[part]
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key) != b.get(key):
                out.append(f"{part}: {key}: {a.get(key)} -> {b.get(key)}")
    return out


def quiet_watchdog(monkeypatch) -> None:
    """The watchdog ticks once an hour: its own writes (state.json, its log) out of the way."""
    for key, value in (("CHECK_INTERVAL", "1h"), ("IDLE", "2h"), ("STALL", "2h")):
        monkeypatch.setenv(f"GPUCTL_GUARDS__{key}", value)


def _train(gpuctl, proj, *flags: str) -> str:
    return json.loads(gpuctl("train", str(proj), *flags, "--json").stdout)["run"]["run_id"]


def _runs(gpuctl) -> dict:
    return {r["run_id"]: r for r in json.loads(gpuctl("status", "--json").stdout)["runs"]}


def _pane(home: Path, cluster: str, node: int, run_id: str) -> tuple[int, bool] | None:
    """(its pid, whether it is dead) of the run's pane on that node; None: no such session."""
    from gpuctl.remote import tmux
    from gpuctl.remote.local import LocalHost

    root = home / "clusters" / cluster
    host = LocalHost(root / "nodes" / str(node) if node else root)  # the chief's is the cluster's own
    res = subprocess.run(tmux.argv(host, "list-panes", "-t", f"={run_id}:", "-F", "#{pane_pid} #{pane_dead}"),
                         capture_output=True, text=True, timeout=10)
    if res.returncode:
        return None
    pid, dead = res.stdout.split()[:2]
    return int(pid), dead == "1"


def every_state(gpuctl, make_project, home: Path) -> tuple[list[str], list[str], str, str]:
    """Clusters in every state: (clusters, runs, the multi-node run with one node ended, the one
    with a late node)."""
    sleeper = make_project("sleeper", {"train.py": SLEEPER})
    quick = make_project("quick", {"train.py": QUICK})
    fails = make_project("fails", {"train.py": FAILS})
    gpuctl("up", "--provider", "local", "--name", "idle")
    gpuctl("up", "--provider", "local", "--name", "busy")
    running = _train(gpuctl, sleeper, "--cluster", "busy")
    queued = _train(gpuctl, sleeper, "--cluster", "busy")
    done = _train(gpuctl, quick, "--cluster", "busy", "--now")
    failed = _train(gpuctl, fails, "--cluster", "busy", "--now")
    stopped = _train(gpuctl, sleeper, "--cluster", "busy", "--now")
    gpuctl("up", "--provider", "local", "--nodes", "2", "--name", "two")
    half = _train(gpuctl, sleeper, "--cluster", "two")
    gpuctl("up", "--provider", "local", "--nodes", "2", "--name", "late")
    late = _train(gpuctl, sleeper, "--cluster", "late")
    gpuctl("up", "--provider", "local", "--name", "gone")
    released = _train(gpuctl, quick, "--cluster", "gone", "--wait")
    gpuctl("down", "gone", "-y")
    wait_for(lambda: _runs(gpuctl)[done]["state"] == "succeeded" and _runs(gpuctl)[failed]["state"] == "failed")
    wait_for(lambda: all(_runs(gpuctl)[r]["node_states"] == ["running", "running"] for r in (half, late)))
    gpuctl("stop", stopped)
    # Node 1 of `two` ends (SIGKILL): its chief would wait for it, billed.
    os.killpg(_pane(home, "two", 1, half)[0], signal.SIGKILL)  # type: ignore[index]
    wait_for(lambda: _pane(home, "two", 1, half)[1])  # type: ignore[index]  (dead, its exit code written by nobody)
    # Node 1 of `late` runs node 0's job, as nodes sharing one work dir do, past a 1 s deadline.
    (home / "clusters" / "late" / "nodes" / "1" / "runs" / late / "node-started").write_text("0\n")
    from gpuctl.ledger import Ledger

    ledger = Ledger(home)
    ledger.put_run(ledger.run(late).model_copy(update={"start_timeout_s": 1.0, "node_states": ()}))
    time.sleep(1.5)
    return ["idle", "busy", "two", "late"], [running, queued, done, failed, stopped, half, late, released], half, late


def _every_look(gpuctl, clusters: list[str], runs: list[str], multi: list[str]) -> None:
    for args in LOOKS:
        gpuctl(*args)
    for c in clusters:
        for args in PER_CLUSTER:
            gpuctl(*(a.format(c=c) for a in args))
    for r in runs:
        for args in PER_RUN + (PER_NODE_RUN if r in multi else []):
            gpuctl(*(a.format(r=r) for a in args))


@pytest.mark.slow  # long waits: full tier (CONTRIBUTING.md, the tiers)
def test_every_look_at_every_state_changes_nothing_outside_the_ledger(gpuctl, make_project, isolated, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("GPUCTL_REMOTE__COMMAND_TIMEOUT_S", str(COMMAND_S))
    quiet_watchdog(monkeypatch)
    clusters, runs, half, late = every_state(gpuctl, make_project, isolated)
    before = instance_side(isolated)
    for _ in range(2):
        _every_look(gpuctl, clusters, runs, [half, late])
        changed = diff(before, instance_side(isolated))
        assert not changed, "\n".join(changed)
    shown = _runs(gpuctl)
    states = {r: shown[r]["state"] for r in runs}
    assert [states[r] for r in runs] == ["running", "queued", "succeeded", "failed", "stopped", "failed", "failed",
                                         "succeeded"], states
    # What the user sees of the multi-node failure: the node that ended it, and the chief still there.
    assert (shown[half]["failed_node"], shown[half]["node_states"]) == (1, ["running", "failed"])
    assert shown[late]["failed_node"] == 1
    out = gpuctl("status").stdout
    assert f"{half} failed on node 1" in out
    # Every host silent (a tmux that only sleeps): the looks still answer, and still change nothing.
    hung = tmp_path / "hung-bin" / "tmux"
    hung.parent.mkdir()
    hung.write_text(HUNG_TMUX)
    hung.chmod(0o755)
    monkeypatch.setenv("PATH", f"{hung.parent}:{os.environ['PATH']}")
    for args in (("status", "--json"), ("cost", "--json"), ("logs", half), ("guard", "show", "--cluster", "two")):
        gpuctl(*args)
    monkeypatch.setenv("PATH", os.environ["PATH"].split(":", 1)[1])
    assert diff(before, instance_side(isolated)) == []


def test_the_act_path_stops_what_a_look_found_left_waiting(gpuctl, make_project, isolated, monkeypatch):
    """The same multi-node failure, then `gpuctl stop RUN` (a command that acts): the chief that
    waited for its ended peer is stopped, and the run keeps its verdict."""
    quiet_watchdog(monkeypatch)
    gpuctl("up", "--provider", "local", "--nodes", "2", "--name", "two")
    run = _train(gpuctl, make_project("sleeper", {"train.py": SLEEPER}), "--cluster", "two")
    wait_for(lambda: _runs(gpuctl)[run]["node_states"] == ["running", "running"])
    os.killpg(_pane(isolated, "two", 1, run)[0], signal.SIGKILL)  # type: ignore[index]
    wait_for(lambda: _runs(gpuctl)[run]["state"] == "failed")
    chief = _pane(isolated, "two", 0, run)
    assert chief is not None and not chief[1], "a look stopped the chief"
    gpuctl("stop", run)
    shown = _runs(gpuctl)[run]
    assert (shown["state"], shown["failed_node"], shown["node_states"]) == ("failed", 1, ["stopped", "failed"])
    chief = _pane(isolated, "two", 0, run)
    assert chief is None or chief[1], "the chief still waits for its ended peer, billed"


@pytest.mark.slow  # a real stall limit passes
def test_with_nobody_looking_the_chiefs_own_guard_ends_its_wait_for_an_ended_peer(gpuctl, make_project, isolated,
                                                                                   monkeypatch):
    """The decision that ends that spend lives on the instance: the chief's watchdog (stall limit 4 s,
    on_stall left at warn) fires for a node of several that waits on its peer; no gpuctl looks."""
    for key, value in (("CHECK_INTERVAL", "1s"), ("IDLE", "2h"), ("STALL", "4s")):
        monkeypatch.setenv(f"GPUCTL_GUARDS__{key}", value)
    gpuctl("up", "--provider", "local", "--nodes", "2", "--name", "two")
    run = _train(gpuctl, make_project("sleeper", {"train.py": SLEEPER}), "--cluster", "two")
    wait_for(lambda: _runs(gpuctl)[run]["node_states"] == ["running", "running"])
    os.killpg(_pane(isolated, "two", 1, run)[0], signal.SIGKILL)  # type: ignore[index]
    fired = isolated / "clusters" / "two" / "guard" / "fired.json"
    wait_for(fired.exists, timeout=60)
    assert "a node of several: it waits for a peer" in fired.read_text()
    chief = _pane(isolated, "two", 0, run)
    assert chief is None or chief[1], "the chief still waits for its ended peer, billed"
