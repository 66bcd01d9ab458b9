"""User data that arms the boot-time hard cap before gpuctl ever connects.

With InstanceInitiatedShutdownBehavior=terminate, powering off ends billing, so this guard alone
bounds the cost of an instance whose laptop, CLI and network all vanished. It needs nothing from
the client: cloud-init runs it at first boot.
"""

from __future__ import annotations

import gzip
import json
import posixpath
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gpuctl.payloads.gpuctl_protocol import WATCHDOG_FILES, GuardConfig
from gpuctl.provision.aws.shipped import lean
from gpuctl.remote import guard as guard_mod

PAYLOADS = Path(__file__).resolve().parents[2] / "payloads"
HARD_CAP_MARK = "/var/lib/gpuctl/hard-cap"


def hard_cap_script(max_hours: float) -> str:
    minutes = max(1, int(round(max_hours * 60)))
    return f"""#!/bin/bash
# gpuctl boot-time guard: power off {max_hours:g} h after boot, whatever happens to the client.
set -u
mkdir -p /var/lib/gpuctl
cat > /etc/systemd/system/gpuctl-hard-cap.service <<'UNIT'
[Unit]
Description=gpuctl hard cap: power off (and so terminate) this instance
[Service]
Type=oneshot
ExecStart=/bin/systemctl poweroff --no-wall
UNIT
cat > /etc/systemd/system/gpuctl-hard-cap.timer <<'UNIT'
[Unit]
Description=gpuctl hard cap timer ({minutes} minutes after boot)
[Timer]
OnBootSec={minutes}min
AccuracySec=30s
[Install]
WantedBy=timers.target
UNIT
if systemctl daemon-reload && systemctl enable --now gpuctl-hard-cap.timer; then
    armed=systemd
else
    shutdown -h +{minutes} "gpuctl hard cap reached"
    armed=shutdown
fi
# Boot time + minutes, for `gpuctl status` to show when the cap fires.
boot=$(( $(date +%s) - $(cut -d. -f1 /proc/uptime) ))
echo "$(( boot + {minutes} * 60 )) $armed" > {HARD_CAP_MARK}
"""


# What the boot-time watchdog keeps of the settings (the rest of its config is filled in on the
# instance, or waits for `gpuctl train`, which rewrites the whole config in the same place).
BOOT_GUARD_KEYS = ("idle_s", "check_interval_s", "gpu_idle_percent", "on_fire", "poweroff_command")
_BOOT = "@GPUCTL_BOOT@"


def workdir_root(workdir: str, user: str) -> str:
    """Where `~/gpuctl` is for the image's login user, as SSH resolves it later."""
    home = "/root" if user == "root" else f"/home/{user}"
    return home + workdir[1:] if workdir == "~" or workdir.startswith("~/") else workdir


def idle_guard_script(guard: dict[str, Any], user: str, root: str) -> str:
    """The watchdog started at boot, idle counted from boot: an instance whose `up --no-wait` (or
    laptop) never got to `train` powers off after `guards.idle`, not at the hard cap. It is the very
    watchdog `train` installs (same files, config and unit or tmux session under the same paths), so
    `train` re-arms it with its own limits and upgrades its code as it would any other."""
    q = shlex.quote
    here = SimpleNamespace(root=root, tmux_socket="gpuctl")
    payload = posixpath.join(root, "payload")
    # started_at is the boot's time, known there only: a placeholder that sed replaces.
    cfg = GuardConfig(**{k: guard[k] for k in BOOT_GUARD_KEYS if k in guard}, runs_dir=posixpath.join(root, "runs"),
                      tmux_socket="gpuctl", stall_s=0, boot_guard=True)
    # The settings' limits, and of the rest only what differs from the watchdog's defaults (16 KB in
    # all); `guard show` reads the limits back before the first `train`.
    boot = {k: v for k, v in cfg.to_dict().items() if k in BOOT_GUARD_KEYS or v != getattr(GuardConfig, k)}
    boot["started_at"] = _BOOT
    lines = ["# gpuctl boot-time idle guard (the watchdog `gpuctl train` re-arms): power off after guards.idle",
             f"root={q(root)}", 'mkdir -p "$root/payload" "$root/guard" "$root/runs"']
    for name in WATCHDOG_FILES:
        text = lean((PAYLOADS / name).read_text())  # the code, without its comments: 16 KB at most
        lines += [f"cat > \"$root/payload/{name}\" <<'GPUCTL_PAYLOAD_END'", text.rstrip("\n"), "GPUCTL_PAYLOAD_END"]
    lines += [
        "boot=$(( $(date +%s) - $(cut -d. -f1 /proc/uptime) ))",
        "cat > \"$root/guard/config.json\" <<'GPUCTL_CONFIG_END'", json.dumps(boot, indent=2, sort_keys=True),
        "GPUCTL_CONFIG_END",
        f"sed -i \"s/\\\"{_BOOT}\\\"/$boot/\" \"$root/guard/config.json\"",
        "chmod 0600 \"$root/guard/config.json\"",
        f"chown -R {q(user)}: \"$root\"",
        "if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then",
        f"cat > /etc/systemd/system/{guard_mod.unit_name(here)} <<'UNIT'",
        guard_mod._systemd_unit(here, "/usr/bin/python3", payload, user).rstrip("\n"), "UNIT",
        f"systemctl daemon-reload && systemctl enable --now {guard_mod.unit_name(here)}",
        "else",
        "cat > \"$root/guard/ensure.sh\" <<'GPUCTL_ENSURE_END'",
        guard_mod._ensure_script(here, "python3", payload).rstrip("\n"), "GPUCTL_ENSURE_END",
        f"chown {q(user)}: \"$root/guard/ensure.sh\"",
        f"su -s /bin/sh {q(user)} -c {q('sh ' + q(posixpath.join(root, 'guard', 'ensure.sh')))}",
        "fi",
    ]
    return "\n".join(lines) + "\n"


def boot_script(max_hours: float, guard: dict[str, Any], user: str, workdir: str) -> bytes:
    """The whole user data: the hard cap, then the idle guard where `guards.idle` is set; gzipped
    (cloud-init takes it so) to stay under EC2's 16 KB with the watchdog's code inside."""
    script = hard_cap_script(max_hours)
    if float(guard.get("idle_s") or 0) > 0:
        script += idle_guard_script(guard, user, workdir_root(workdir, user))
    return gzip.compress(script.encode(), mtime=0)
