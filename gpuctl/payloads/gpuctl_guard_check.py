"""`gpuctl guard show --check` on the instance: the watchdog's own code takes one look, dry (it
writes, logs and fires nothing), and prints what it sees, what it would decide now, and whether
firing can work here, as one JSON line. Stdlib only; beside gpuctl_watchdog.py.

Usage: python gpuctl_guard_check.py GUARD_DIR/config.json
"""

import json
import os
import sys
import time

# A look writes nothing on the instance: not even the bytecode of the watchdog's module, which
# only this check imports (the watchdog runs it as its main script).
sys.dont_write_bytecode = True

from gpuctl_watchdog import Watchdog, read_json, sh  # noqa: E402  (beside this file on the instance)


def check(config_path):
    """One look, as the running watchdog would take it now; nothing written, nothing fired."""
    dog = Watchdog(config_path)
    dog.dry = True
    cfg = dog.config()
    if cfg is None:
        return {"error": "no config at %s" % dog.config_path}
    state, reason, detail = dog.tick()
    running = read_json(os.path.join(dog.guard_dir, "state.json"), {}) or {}
    poweroff = cfg.poweroff_command.split()
    sudo = sh(["sudo", "-n", "true"]) if poweroff[:1] == ["sudo"] else None
    return {"now": time.time(), "state": state, "would_fire": reason, "detail": detail,
            "watchdog": {"pid": running.get("pid"), "last_look": running.get("at"),
                         "alive": alive(running.get("pid"))},
            "probes": {"python": sys.version.split()[0], "utmp": state["logins"]["utmp"],
                       "nvidia_smi": which("nvidia-smi"), "systemd": os.path.isdir("/run/systemd/system"),
                       "poweroff_command": poweroff[0] if poweroff else None,
                       "poweroff_found": bool(poweroff) and which(poweroff[0]) is not None,
                       "sudo_without_password": None if poweroff[:1] != ["sudo"] else bool(sudo and sudo.returncode == 0)}}


def alive(pid):
    try:
        os.kill(int(pid), 0)
        return True
    except (TypeError, ValueError, OSError):
        return False


def which(name):
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) + ["/usr/sbin", "/sbin"]:
        path = os.path.join(d, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: gpuctl_guard_check.py GUARD_DIR/config.json\n")
        sys.exit(2)
    sys.stdout.write(json.dumps(check(sys.argv[1])) + "\n")
