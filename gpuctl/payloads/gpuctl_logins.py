"""Who is logged in, for gpuctl's watchdog: the interactive logins in the instance's utmp, and
why every other record there does not count. Stdlib only; Python 3.8+; imported by
gpuctl_watchdog.py from the same directory on the instance.
"""

import os
import platform
import re
import stat
import struct
from typing import Dict

# The login records, read directly: `who` output differs between coreutils versions and locales,
# and it hides the record's pid, which tells a live login from a stale record.
UTMP_PATHS = ("/run/utmp", "/var/run/utmp")
# glibc's `struct utmp` on Linux: type, pid, line, id, user, host, exit status, session, time,
# IPv6 address, reserved. On x86_64 (and 32-bit x86) glibc keeps the session and the time 32-bit
# for compatibility (__WORDSIZE_TIME64_COMPAT32): 384 bytes. On aarch64 (Graviton: g5g) and other
# 64-bit Linux they are 64-bit: 400 bytes. The time is field 9 in both.
UTMP_COMPAT32 = struct.Struct("=h2xi32s4s32s256s2hi2i4i20s")
UTMP_LP64 = struct.Struct("=h2xi32s4s32s256s2hqqq4i20s4x")


def utmp_record(size_of_file):
    """The record layout of this machine, checked against the file: one whose size the file is not a
    multiple of is the wrong one."""
    native = UTMP_COMPAT32 if platform.machine() in ("x86_64", "amd64", "i386", "i686") else UTMP_LP64
    other = UTMP_LP64 if native is UTMP_COMPAT32 else UTMP_COMPAT32
    if size_of_file % native.size and not size_of_file % other.size:
        return other
    return native
USER_PROCESS = 7
# The host field of a pane's record (tmux via libutempter, GNU screen, an X terminal): not an
# address sshd would write ("::1" and other IPv6 addresses do not match).
MULTIPLEXER_HOST = re.compile(r"tmux\(|:(\d|pts/|tty)")
# Linux updates a terminal's access time (its last input) only when it moves to another 8-second
# slot, so that the timing of keystrokes cannot be read from it (tty_update_time). The last input
# lies before the end of the slot the access time is in: that end is what the idle guard counts from.
TTY_TIME_SLOT = 8


def read_utmp():
    """(path, the USER_PROCESS records in it); (None, []) where the system keeps no utmp."""
    for path in UTMP_PATHS:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            break
        except OSError:
            continue
    else:
        return None, []
    out = []
    record = utmp_record(len(data))
    size = record.size
    for off in range(0, len(data) - size + 1, size):
        fields = record.unpack_from(data, off)
        if fields[0] != USER_PROCESS:
            continue
        text = [f.split(b"\0", 1)[0].decode("utf-8", "replace") for f in fields[2:6]]
        out.append({"pid": fields[1], "line": text[0], "user": text[2], "host": text[3], "at": fields[9]})
    return path, out


def proc_comm(pid):
    """The process's name, "" when there is no such process."""
    try:
        with open("/proc/%d/comm" % pid) as fh:
            return fh.read().strip() or "?"
    except (OSError, ValueError):
        return ""


def process_younger_than(pid, since):
    """Whether the process with `pid` started after `since` (plus slack): the pid was reused and
    the record that names it is stale. False when it cannot be told."""
    if since <= 0:  # no time in the record (or a 32-bit time past 2038)
        return False
    try:
        with open("/proc/%d/stat" % pid) as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return boot + ticks / float(os.sysconf("SC_CLK_TCK")) > since + 2
    except (OSError, ValueError, IndexError, StopIteration):
        return False


def summarize(ignored):
    """"2 tmux pane, 1 no input for 12s": why utmp records were not counted, for the log."""
    counts: Dict[str, int] = {}
    for entry in ignored:
        counts[entry["why"]] = counts.get(entry["why"], 0) + 1
    return ", ".join("%d %s" % (n, why) for why, n in sorted(counts.items()))


def logins(now, idle_s):
    """(utmp path or None, counted, ignored): the interactive logins that keep the instance busy, and the other
    login records with why each does not count. Each is a dict for state.json.

    A login is a USER_PROCESS record in utmp: sshd writes one per pty session (gpuctl's own
    commands run without a pty and write none). Not counted:
      - tmux panes: tmux linked with libutempter (Debian, Ubuntu) records every pane, the
        watchdog's own and every job's among them; so does GNU screen. Their host reads
        "tmux(PID).%N" (screen ":pts/N:S.M", an X terminal ":0"), and tmux's pid is its
        server's. A login whose shell became a tmux *client* (`gpuctl attach`, `ssh -t host
        tmux attach`) is a person and counts.
      - stale records: the login's process is gone (or its pid now names a younger process),
        e.g. after sshd was killed without writing the logout.
      - quiet logins: no input on the terminal for `idle_s` (its access time, as `w` shows
        IDLE). sshd keeps a vanished laptop's connection open for hours without
        ClientAliveInterval; the guard cannot tell it from a user who stopped typing, and
        treats both alike.
    """
    counted, ignored = [], []
    path, records = read_utmp()
    for rec in records:
        entry = {"user": rec["user"], "line": rec["line"], "host": rec["host"], "pid": rec["pid"]}
        why = None
        comm = proc_comm(rec["pid"])
        if MULTIPLEXER_HOST.match(rec["host"]) or comm == "tmux: server":
            why = "tmux pane"
        elif not comm or process_younger_than(rec["pid"], rec["at"]):
            why = "process gone"
        else:
            try:
                st = os.stat(os.path.join("/dev", rec["line"]))
            except (OSError, ValueError):
                st = None
            if st is None or not stat.S_ISCHR(st.st_mode):
                why = "no terminal"
            else:
                last_input = min(now, (int(st.st_atime) // TTY_TIME_SLOT + 1) * TTY_TIME_SLOT)
                entry["last_input"] = last_input
                entry["quiet_s"] = round(now - last_input, 1)
                if idle_s > 0 and now - last_input >= idle_s:
                    why = "no input for %.0fs" % (now - last_input)
        if why:
            entry["why"] = why
            ignored.append(entry)
        else:
            counted.append(entry)
    return path, counted, ignored

# --- acting -------------------------------------------------------------------------------------
