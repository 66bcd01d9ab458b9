"""Installing and talking to the watchdog (payloads/gpuctl_watchdog.py) on a host.

Where systemd runs (the Deep Learning AMIs) the watchdog is a service with Restart=always.
Elsewhere it runs in a restart loop in a session of gpuctl's own tmux server, and a cron entry,
where crontab exists, brings the session back if the whole tmux server dies. Either way it
needs nothing from the client once installed.
"""

from __future__ import annotations

import posixpath
import shlex
from typing import Any

from gpuctl.model import untrusted
from gpuctl.payloads import gpuctl_protocol as protocol
from gpuctl.remote.tmux import server_env
from gpuctl.remote.guard_files import Fired, GuardConfig, WatchdogState
from gpuctl.remote.host import Host

GUARD_DIR = "guard"
WATCHDOG = "gpuctl_watchdog.py"
CHECK = "gpuctl_guard_check.py"  # one dry look by the watchdog's code (`guard show --check`)
SESSION = "gpuctl-watchdog"
CRON_MARK = "# gpuctl-watchdog"


def guard_dir(host: Host) -> str:
    return posixpath.join(host.root, GUARD_DIR)


def config_path(host: Host) -> str:
    return posixpath.join(guard_dir(host), "config.json")


def read_config(host: Host, notes: list[str] | None = None) -> dict[str, Any]:
    """The watchdog's config as written on the host, each field checked (guard_files.py); what
    does not hold is left out and said in `notes`."""
    return _read(host, "config.json", GuardConfig, notes)


def _read(host: Host, name: str, model: type, notes: list[str] | None) -> dict[str, Any]:
    raw = host.read_bytes(posixpath.join(guard_dir(host), name), 0, untrusted.MAX_JSON + 1)
    return untrusted.read(model, raw, f"guard/{name} from {host.label}", notes)


def write_config(host: Host, cfg: protocol.GuardConfig) -> None:
    host.write_text(config_path(host), cfg.to_json())


def _ensure_script(host: Host, python: str, payload_dir: str) -> str:
    q = shlex.quote
    loop = (f"while :; do {q(python)} {q(posixpath.join(payload_dir, WATCHDOG))} {q(config_path(host))} "
            f">> {q(posixpath.join(guard_dir(host), 'watchdog.out'))} 2>&1; sleep 2; done")
    tmux = f"tmux -L {q(host.tmux_socket)}"
    return (
        "#!/bin/sh\n"
        "# Written by gpuctl: start the watchdog's session unless it runs. Cron calls this every minute.\n"
        f"{tmux} has-session -t ={SESSION} 2>/dev/null && exit 0\n"
        # Marked like every process of this cluster's tmux server, so `down` finds them all.
        f"cd {q(host.root)} && exec {shlex.join(server_env(host))} {tmux} new-session -d -s {SESSION} {q(loop)}\n"
    )


def _cron_line(host: Host) -> str:
    """This cluster's crontab line, matched whole (`grep -x`): cluster `exp`'s must never take
    `exp2`'s with it, as a match on a part of the line did."""
    ensure = posixpath.join(guard_dir(host), "ensure.sh")
    return f"* * * * * sh {shlex.quote(ensure)} {CRON_MARK} {host.root}"


def unit_name(host: Host) -> str:
    """The systemd unit of this cluster's watchdog: one per cluster on a host that has several."""
    return "gpuctl-watchdog.service" if host.tmux_socket == "gpuctl" else f"gpuctl-watchdog-{host.tmux_socket}.service"


def _systemd_unit(host: Host, python: str, payload_dir: str, user: str) -> str:
    return (
        "[Unit]\nDescription=gpuctl watchdog: ends the spend when idle, hung, over budget or done\n"
        "[Service]\n"
        f"ExecStart={python} {posixpath.join(payload_dir, WATCHDOG)} {config_path(host)}\n"
        f"User={user}\nRestart=always\nRestartSec=2\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )


def install(host: Host, cfg: protocol.GuardConfig, python: str, payload_dir: str) -> str:
    """Write the config and make sure the watchdog runs; how it runs ("systemd" or "tmux...")."""
    write_config(host, cfg)
    probe = host.run(["sh", "-c",
                      '[ -d /run/systemd/system ] && command -v systemctl >/dev/null && '
                      '{ [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; } && id -un'], check=False)
    user = probe.stdout.strip()
    if probe.returncode == 0 and user:
        unit = posixpath.join(guard_dir(host), unit_name(host))
        host.write_text(unit, _systemd_unit(host, python, payload_dir, user))
        sudo = "" if user == "root" else "sudo -n "
        name = shlex.quote(unit_name(host))
        host.run(["sh", "-c", f"{sudo}install -m 0644 {shlex.quote(unit)} /etc/systemd/system/{name}"
                              f" && {sudo}systemctl daemon-reload && {sudo}systemctl enable --now {name}"])
        return f"systemd service {unit_name(host).removesuffix('.service')} (Restart=always)"
    ensure = posixpath.join(guard_dir(host), "ensure.sh")
    host.write_text(ensure, _ensure_script(host, python, payload_dir), mode=0o755)
    host.run(["sh", ensure])
    line = _cron_line(host)
    cron = host.run(["sh", "-c", "command -v crontab >/dev/null && { crontab -l 2>/dev/null | grep -vxF "
                     f"{shlex.quote(line)}; echo {shlex.quote(line)}; }} | crontab -"],
                    check=False)
    return "tmux session gpuctl-watchdog" + (", revived by cron" if cron.returncode == 0 else " (no crontab here)")


def uninstall(host: Host) -> None:
    """Stop the watchdog for good (before `down` releases a host that stays up)."""
    host.run(["sh", "-c",
              f"command -v crontab >/dev/null && crontab -l 2>/dev/null | grep -vxF {shlex.quote(_cron_line(host))}"
              " | crontab - ; "
              # No tmux here: its session ends with the cluster's processes (teardown.end_cluster),
              # and a tmux that hangs must not keep the unit below enabled.
              f"if [ -f /etc/systemd/system/{shlex.quote(unit_name(host))} ]; then "
              f"S=; [ \"$(id -u)\" = 0 ] || S='sudo -n'; $S systemctl disable --now {shlex.quote(unit_name(host))}; fi; "
              # Its limits and what it saw go too: the next cluster on this host starts clean.
              f"rm -f {shlex.quote(config_path(host))} {shlex.quote(posixpath.join(guard_dir(host), 'state.json'))}; true"],
             check=False)


def output_tail(host: Host, lines: int = 3) -> str:
    """The last lines the watchdog printed (its errors, when it cannot start)."""
    data = host.read_bytes(posixpath.join(guard_dir(host), "watchdog.out"), -(16 << 10)) or b""
    return untrusted.one_line(" / ".join(data.decode("utf-8", "replace").strip().splitlines()[-lines:]), 600)


def state(host: Host, notes: list[str] | None = None) -> dict[str, Any]:
    """The watchdog's latest picture (state.json), each field checked, or {} before its first look."""
    return _read(host, "state.json", WatchdogState, notes)


def fired(host: Host, notes: list[str] | None = None) -> dict[str, Any]:
    """fired.json: the last guard that fired (written before the firing acts; state.json says it
    only after), each field checked, or {}."""
    return _read(host, "fired.json", Fired, notes)


DECISIONS_SHOWN = 4 << 20  # of the decision log's end: `logs --guard`


def decisions(host: Host) -> str:
    data = host.read_bytes(posixpath.join(guard_dir(host), "decisions.log"), -DECISIONS_SHOWN) or b""
    return data.decode("utf-8", "replace")


def set_hard_cap(host: Host, max_hours: float) -> bool:
    """Move the boot-time timer (armed by user data) to `max_hours` after boot, where it exists."""
    minutes = max(1, int(round(max_hours * 60)))
    script = (
        "[ -f /etc/systemd/system/gpuctl-hard-cap.timer ] || exit 3; S=; [ \"$(id -u)\" = 0 ] || S='sudo -n'; "
        "$S mkdir -p /etc/systemd/system/gpuctl-hard-cap.timer.d && "
        f"printf '[Timer]\\nOnBootSec=\\nOnBootSec={minutes}min\\n' | $S tee /etc/systemd/system/gpuctl-hard-cap.timer.d/gpuctl.conf >/dev/null && "
        "$S systemctl daemon-reload && $S systemctl restart gpuctl-hard-cap.timer"
    )
    return host.run(["sh", "-c", script], check=False).returncode == 0
