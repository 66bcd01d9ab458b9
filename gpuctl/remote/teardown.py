"""Ending everything of a cluster on one host whose machine stays (`down` on local and ssh).

The order is what keeps `down` bounded on a host whose tmux hangs: the watchdog's revivers go
first (cron, systemd: no tmux), then every process carrying the cluster's mark is ended through
/proc (no tmux either), and only then is the cluster's tmux server told to go, for a host
without /proc. A tmux that hangs there costs one deadline, after the jobs are gone.
"""

from __future__ import annotations

from gpuctl.errors import RemoteTimeout
from gpuctl.remote import guard, jobs, tmux
from gpuctl.remote.host import Host


def end_cluster(host: Host) -> list[str]:
    """Stop the cluster's watchdog for good and end its processes on the host; the processes
    still there ("pid command"), [] when none is."""
    guard.uninstall(host)  # the host stays up: its cron entry or unit must not revive the watchdog
    survivors = jobs.end_processes(host)  # jobs, their children and daemons, the watchdog, the server
    try:
        tmux.kill_server(host)  # what /proc could not show (a host without it)
    except RemoteTimeout:
        pass  # a tmux that hangs: every process with the cluster's mark is gone already
    return survivors
