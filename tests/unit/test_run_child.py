"""cli/common.run_child: a child gpuctl runs in the foreground (ssh, an `ssh -N -L` forward) never
outlives gpuctl. A terminal's Ctrl-C reaches both; a SIGINT to gpuctl alone (a script's `kill
-INT`, a supervisor) reached only gpuctl, which left `gpuctl tensorboard`'s forward holding its port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from tests.waits import wait_for

CHILD = textwrap.dedent("""
    import sys
    from gpuctl.cli.common import run_child
    sys.exit(run_child([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"]))
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_sigint_to_gpuctl_alone_ends_its_child_too():
    gpuctl = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # no terminal: the signal goes to gpuctl only
    try:
        assert gpuctl.stdout is not None
        child = int(gpuctl.stdout.readline())
        os.kill(gpuctl.pid, signal.SIGINT)
        assert gpuctl.wait(timeout=30) == 130  # as a shell reports Ctrl-C
        wait_for(lambda: not _alive(child), timeout=15, what="the child to end with gpuctl")
    finally:
        try:
            os.killpg(gpuctl.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
