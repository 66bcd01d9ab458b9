"""User data that arms the boot-time hard cap before gpuctl ever connects.

With InstanceInitiatedShutdownBehavior=terminate, powering off ends billing, so this guard alone
bounds the cost of an instance whose laptop, CLI and network all vanished. It needs nothing from
the client: cloud-init runs it at first boot.
"""

from __future__ import annotations

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
