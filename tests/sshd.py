"""Real OpenSSH test hosts: one network namespace per host, each with its own IP (10.251.X.Y, a
veth pair to this machine), its own tmux socket directory (/tmp/tmux-0, so its own tmux), its
own /srv (gpuctl's work dir in these tests, a small tmpfs so "disk full" is real) and its own
/run with a real /run/utmp (so tmux panes and pty logins are recorded as on Ubuntu), running
/usr/sbin/sshd in the foreground. Login holds an interactive pty login to a host open.
Traffic stays inside namespaces the tests create. Needs root (as CI and this workplace run).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.waits import wait_for

SUBNET = "10.251."
# Hosts behind a bastion: a veth pair between the bastion's namespace and theirs, in this subnet,
# which this machine's routing table rejects outright (nothing leaves for the default gateway).
BEHIND_SUBNET = "10.252."
WORKDIR = "/srv/gpuctl"
ROOT = WORKDIR + "/box"  # where the tests' cluster ("box") works on a host: WORKDIR/CLUSTER
# Where pip reads this machine's own settings (an image's mirror of PyPI, constraints); the pip of
# a test host reads none of them, as on a fresh instance (the lab hides them, like root's ~/.bashrc).
PIP_CONFIGS = ("/root/.config/pip/pip.conf", "/root/.pip/pip.conf", "/etc/xdg/pip/pip.conf")
# Ends every tmux server on a host (gpuctl's, one per cluster, and the user's) and empties its /srv
# (gpuctl's work dirs, the poweroff marks).
CLEAN = "for s in /tmp/tmux-0/*; do tmux -S \"$s\" kill-server; done 2>/dev/null; rm -rf /srv/*"


# Each host's own /run, as on an Ubuntu instance: /run/sshd (sshd's privilege separation
# directory) and a real /run/utmp (root:utmp 0664), so sshd records every pty login there and
# tmux, linked with libutempter as Debian and Ubuntu ship it, records every pane. This machine's
# own /run has no utmp, and nothing written here leaves the host's mount namespace. /var/log is
# private too: sshd appends each login to /var/log/wtmp and lastlog.
RUN_AS_UBUNTU = (
    "mount -t tmpfs -o mode=755,size=16m tmpfs /run && mount -t tmpfs -o mode=755,size=16m tmpfs /var/log && "
    "mkdir -m 755 /run/sshd && : > /run/utmp && chmod 664 /run/utmp && { chgrp utmp /run/utmp 2>/dev/null || true; }"
)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check)


@dataclass
class TestHost:
    index: int
    base: Path  # this host's files on this machine (outside /tmp, which the host does not see)
    tag: str
    srv_size: str = "256m"
    proc: subprocess.Popen | None = None
    pubkey: str = ""
    extra_config: list[str] = field(default_factory=list)
    hidden: tuple[str, ...] = ()  # programs this host does not have (bind-mounted away)
    behind: TestHost | None = None  # reachable only from this host's namespace (a bastion), not from here

    @property
    def ns(self) -> str:
        return f"gpuctl-{self.tag}-{self.index}"

    @property
    def _octet(self) -> int:
        return tag_octet(self.tag)

    @property
    def _subnet(self) -> str:
        return BEHIND_SUBNET if self.behind else SUBNET

    @property
    def ip(self) -> str:
        return f"{self._subnet}{self._octet}.{4 * self.index + 2}"

    @property
    def services_ip(self) -> str:
        """One address on this machine that every host of the lab reaches (through its gateway), as
        every instance reaches 169.254.169.254: the fake IMDS and the moto server listen there."""
        return f"{SUBNET}{self._octet}.253"

    @property
    def gateway(self) -> str:
        """The other end of its veth pair: on this machine, or in the bastion's namespace."""
        return f"{self._subnet}{self._octet}.{4 * self.index + 1}"

    @property
    def _rejected_net(self) -> str:
        return f"{BEHIND_SUBNET}{self._octet}.0/24"

    @property
    def veth(self) -> str:
        return f"gv{self.tag[-6:]}{self.index}"[:15]

    @property
    def address(self) -> str:
        return f"root@{self.ip}"

    def create(self, client_pub: str) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        _run("ip", "netns", "add", self.ns)
        _run("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        near = []  # where the near end of the pair lives: here, or in the bastion's namespace
        if self.behind:
            _run("ip", "link", "set", self.veth, "netns", self.behind.ns)
            near = ["ip", "netns", "exec", self.behind.ns]
            # No route from here: connecting fails at once instead of leaving by the default route.
            _run("ip", "route", "replace", "unreachable", self._rejected_net)
        _run(*near, "ip", "addr", "add", f"{self.gateway}/30", "dev", self.veth)
        _run(*near, "ip", "link", "set", self.veth, "up")
        for cmd in (["ip", "addr", "add", f"{self.ip}/30", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"],
                    ["ip", "link", "set", "lo", "up"]):
            _run("ip", "netns", "exec", self.ns, *cmd)
        if not self.behind:
            self.routes()
            # Here, on the loopback device: shared by the lab's hosts, removed with the last of them.
            _run("ip", "addr", "replace", f"{self.services_ip}/32", "dev", "lo")
        (self.base / "authorized_keys").write_text(client_pub)
        self.new_host_key()

    def routes(self) -> None:
        """The host's routes to this machine's services address and to the lab's other hosts
        (through this machine, with forwarding on: peers(), as a cluster's nodes reach each other).
        Set again after its link was down (unreachable()): the kernel drops them with the link,
        and a spot test on that host later never reached the fake IMDS (CI failed so)."""
        if self.behind:
            return
        _run("ip", "netns", "exec", self.ns, "ip", "link", "set", "eth0", "up")
        for net in (f"{self.services_ip}/32", f"{SUBNET}{self._octet}.0/24"):
            _run("ip", "netns", "exec", self.ns, "ip", "route", "replace", net, "via", self.gateway)

    def new_host_key(self) -> None:
        key = self.base / "ssh_host_ed25519_key"
        key.unlink(missing_ok=True)
        key.with_suffix(".pub").unlink(missing_ok=True)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        self.pubkey = key.with_suffix(".pub").read_text().strip()

    def start(self) -> None:
        cfg = self.base / "sshd_config"
        cfg.write_text("\n".join([
            f"ListenAddress {self.ip}", "Port 22",
            f"HostKey {self.base / 'ssh_host_ed25519_key'}",
            f"AuthorizedKeysFile {self.base / 'authorized_keys'}",
            f"PidFile {self.base / 'sshd.pid'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", "AllowTcpForwarding yes", "X11Forwarding no", "PrintMotd no",
            "Subsystem sftp internal-sftp", "LogLevel VERBOSE", *self.extra_config,
        ]) + "\n")
        # Hidden too, always: this machine's pip settings. An index of its own (a local mirror) let
        # the setup step on a host "without network" install all of TensorFlow (46 s) before failing.
        pip = tuple(p for p in PIP_CONFIGS if Path(p).is_file())
        hide = "".join(f"mount --bind /dev/null {p} && " for p in (*self.hidden, *pip))
        # root's shell start-up files as on a fresh instance, not this machine's: a developer's
        # ~/.bashrc (pyenv init, a stale rehash lock that waits 60 s) must not slow every command.
        rc = self.base / "bashrc"
        rc.write_text("# a fresh instance's root: nothing to set up\n")
        shell_rc = "".join(f"mount --bind {rc} {p} && " for p in ("/root/.bashrc", "/root/.profile")
                           if Path(p).is_file())
        # Only tmux's socket directory is private, not all of /tmp: the repository (and its .venv,
        # the Python the jobs run with) may itself live under /tmp, as in CI's clone.
        Path("/tmp/tmux-0").mkdir(mode=0o700, exist_ok=True)
        inner = (
            f"mount -t tmpfs -o mode=700 tmpfs /tmp/tmux-0 && mount -t tmpfs -o size={self.srv_size} tmpfs /srv && "
            f"{RUN_AS_UBUNTU} && {hide}{shell_rc}exec /usr/sbin/sshd -D -e -f {cfg}"
        )
        log = open(self.base / "sshd.log", "ab")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
            stdout=log, stderr=subprocess.STDOUT,
        )
        def listening() -> bool:
            if self._listening():
                return True
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd for {self.ns} exited: {(self.base / 'sshd.log').read_text()[-2000:]}")
            return False

        try:
            wait_for(listening, 20, every=0.1)
        except AssertionError:
            raise RuntimeError(f"sshd for {self.ns} did not listen") from None

    def _listening(self) -> bool:
        if self.behind:  # only the bastion's namespace can reach it
            probe = f"exec 3<>/dev/tcp/{self.ip}/22"
            return _run("ip", "netns", "exec", self.behind.ns, "timeout", "1", "bash", "-c", probe, check=False).returncode == 0
        try:
            with socket.create_connection((self.ip, 22), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            # Kill everything in the host's namespace: sshd and the jobs it started (tmux, python).
            pids = _run("ip", "netns", "pids", self.ns, check=False).stdout.split()
            for pid in pids:
                _run("kill", "-9", pid, check=False)
            self.proc.wait(10)
        self.proc = None

    def restart(self, srv_size: str | None = None, hidden: tuple[str, ...] = ()) -> None:
        """A fresh host: new /tmp, /srv and /run (so no tmux server, no files, an empty utmp), same IP
        and host key."""
        self.stop()
        self.srv_size = srv_size or "256m"
        self.hidden = hidden
        _run("ip", "netns", "exec", self.ns, "ip", "link", "set", "eth0", "up")
        self.routes()
        self.start()

    def unreachable(self) -> None:
        """Packets to this host go nowhere (its link is down): connecting times out."""
        _run("ip", "netns", "exec", self.ns, "ip", "link", "set", "eth0", "down")

    def run(self, command: str) -> subprocess.CompletedProcess:
        """A shell command inside the host's namespaces (its /srv, its /tmp), as the host sees them."""
        assert self.proc is not None
        # The started process itself: `ip netns exec`, unshare and sh each exec the next, so it is
        # the listening sshd (retitled "sshd: ... [listener]"), in the host's namespaces for the
        # host's whole life. Not a process looked up by its command line: OpenSSH 9.2 re-executes
        # itself for each connection as "/usr/sbin/sshd -D ... -R", and nsenter into one that ended
        # a moment later ran nothing: the command's output came back empty (ci10-ci12).
        if self.proc.poll() is not None:  # nsenter into what is left of it would run nothing, silently
            raise RuntimeError(f"the sshd of {self.ns} has exited: {(self.base / 'sshd.log').read_text()[-500:]}")
        return _run("nsenter", "-t", str(self.proc.pid), "-m", "-n", "sh", "-c", command, check=False)

    def who(self) -> list[str]:
        """The host's utmp as `who -u` shows it: one line per login and per tmux pane."""
        return [line for line in self.run("who -u").stdout.splitlines() if line.strip()]

    def ssh_argv(self, key: Path, known_hosts: Path) -> list[str]:
        """Plain OpenSSH asking for a pty login here (`-tt`: a terminal even when this side has
        none), with the lab's key and gpuctl's known_hosts, the host key checked strictly."""
        return ["ssh", "-tt", "-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes",
                "-o", f"UserKnownHostsFile={known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", self.address]

    def pids(self, pattern: bytes) -> list[int]:
        """Processes in this host's namespace whose command line matches `pattern` (a regex)."""
        import re

        out = []
        for pid in _run("ip", "netns", "pids", self.ns, check=False).stdout.split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue  # it just exited
            if re.search(pattern, cmdline):
                out.append(int(pid))
        return out

    def _others_alive(self) -> bool:
        """Whether another host of this test run (any lab) still has its namespace."""
        names = _run("ip", "netns", "list", check=False).stdout.split()
        return any(n.startswith(f"gpuctl-{self.tag}-") and n != self.ns for n in names)

    def destroy(self) -> None:
        self.stop()
        _run("ip", "link", "del", self.veth, check=False)
        _run("ip", "netns", "del", self.ns, check=False)  # takes a behind-host's veth pair with it
        if not self.behind and not self._others_alive():
            # Shared by every lab of this test run: a lab torn down early (the node lab) must not
            # take it from one still in use (the session's hosts reach IMDS and moto there).
            _run("ip", "addr", "del", f"{self.services_ip}/32", "dev", "lo", check=False)
        if self.behind:
            _run("ip", "route", "del", "unreachable", self._rejected_net, check=False)
        shutil.rmtree(self.base, ignore_errors=True)


class Login:
    """An interactive SSH login held open, as a person at a terminal holds one: `argv` (`gpuctl
    ssh`, or TestHost.ssh_argv) runs on a pseudo-terminal of its own here, so ssh asks sshd for a
    pty and sshd records the login in the host's utmp. type() sends keystrokes; what the terminal
    shows is collected in `output`. Use as a context manager: the login ends on leaving."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        import threading

        self.master, slave = os.openpty()
        # ssh needs only a terminal on stdin to ask sshd for a pty (`ssh -t`); a session of its own
        # keeps the test's signals (Ctrl-C) away from it.
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        self.output = bytearray()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: the client closed the terminal
                return
            if not chunk:
                return
            self.output += chunk

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def wait_for(self, needle: str, timeout: float = 20) -> None:
        def seen() -> bool:
            if needle in self.text:
                return True
            ended = self.proc.poll() is not None and not self._reader.is_alive()
            assert not ended, f"{needle!r} not seen on the login's terminal, now closed; it shows:\n{self.text[-2000:]}"
            return False

        try:
            wait_for(seen, timeout, every=0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the login's terminal shows:\n{self.text[-2000:]}") from None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def pause(self) -> None:
        """The laptop goes to sleep: the client stops, its TCP connection stays open, sshd sees nothing."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self, timeout: float = 10) -> int:
        """Log out (`exit`); the client is killed if it does not end in `timeout`."""
        if self.alive():
            self.resume()
            self.type("exit\n")
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._reader.join(timeout)
        try:
            os.close(self.master)
        except OSError:
            pass
        return self.proc.returncode

    def __enter__(self) -> Login:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class peers:
    """Context manager: this machine forwards between the lab's hosts (net.ipv4.ip_forward), so
    they reach each other as a cluster's nodes do. Shared by every process that asks (the test
    session holds it from start to end, so it is set once; xdist workers and concurrent runs ask
    too): the old setting comes back when the last of them leaves, never under another's feet."""

    PATH = Path("/proc/sys/net/ipv4/ip_forward")
    USERS = Path("/run/gpuctl-tests-ip-forward.json")  # {"before": "0", "pids": [...]}, under flock

    def _update(self, change) -> None:
        with open(self.USERS.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = json.loads(self.USERS.read_text())
            except (OSError, ValueError):
                state = {"before": self.PATH.read_text().strip(), "pids": []}
            state["pids"] = [p for p in state["pids"] if Path(f"/proc/{p}").exists()]  # the killed ones
            change(state["pids"])
            if state["pids"]:
                self.PATH.write_text("1\n")
                self.USERS.write_text(json.dumps(state))
            else:
                self.PATH.write_text(state["before"] + "\n")
                self.USERS.unlink(missing_ok=True)

    def __enter__(self) -> peers:
        self._update(lambda pids: pids.append(os.getpid()))
        return self

    def __exit__(self, *exc: object) -> None:
        self._update(lambda pids: pids.remove(os.getpid()) if os.getpid() in pids else None)


@contextlib.contextmanager
def running_lab(kind: str, names: dict[int, str]):
    """(client key, hosts): a lab of test hosts (index -> name), started; destroyed at the end."""
    base, key, tag = prepare(kind)
    hosts = [TestHost(i, base / name, tag=tag) for i, name in names.items()]
    try:
        for h in hosts:
            h.create(key.with_suffix(".pub").read_text())
            h.start()
        yield key, hosts
    finally:
        for h in hosts:
            h.destroy()
        shutil.rmtree(base, ignore_errors=True)


def fresh(hosts, files: dict[str, str] | None = None) -> None:
    """Each host as new: empty /srv and /tmp, no tmux server (restarted when it must be); then
    `files` (path -> text) written there, as a host that ran gpuctl before keeps them."""
    for h in hosts:
        h.routes()  # a test may have taken its link down (unreachable()), and its routes with it
        if h.proc is None or h.hidden or h.srv_size != "256m" or h.proc.poll() is not None:
            h.restart()
        else:  # cheaper than a restart: end gpuctl's jobs there and empty its work dir
            h.run(CLEAN)
        for path, text in (files or {}).items():
            q = shlex.quote(path)
            h.run(f"mkdir -p \"$(dirname {q})\" && printf %s {shlex.quote(text)} > {q}")


def cleanup_stale() -> None:
    """Namespaces and links left by an earlier test run that was killed (its pid is gone);
    those of a run still going (a CI run beside a developer's) are left alone."""
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if not (name.startswith("gpuctl-") and len(parts) == 3):
            continue
        digits = "".join(c for c in parts[1].partition("o")[0] if c.isdigit())
        if digits and Path(f"/proc/{digits}").exists():
            continue  # its test run is alive
        for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
            _run("kill", "-9", pid, check=False)
        _run("ip", "netns", "del", name, check=False)
        veth = f"gv{parts[1][-6:]}{parts[2]}"[:15]
        _run("ip", "link", "del", veth, check=False)
        octet = tag_octet(parts[1])
        _run("ip", "route", "del", "unreachable", f"{BEHIND_SUBNET}{octet}.0/24", check=False)
        _run("ip", "addr", "del", f"{SUBNET}{octet}.253/32", "dev", "lo", check=False)


# Whether the test being set up is marked sshd (tests/conftest.py sets it; None outside pytest).
MARKED: bool | None = None


def prepare(kind: str) -> tuple[Path, Path, str]:
    """(base dir, client key, tag) for a lab of test hosts; stale labs of dead runs removed first.
    Fails the test with the reason when hosts cannot be made here."""
    import pytest

    if MARKED is False:
        pytest.fail("this test starts sshd test hosts but is not marked sshd, so --fast would run it: add its lab "
                    "fixture to TIER_FIXTURES['sshd'] in tests/conftest.py (or mark the test sshd)")
    reason = available()
    if reason:
        pytest.fail(reason)
    cleanup_stale()
    base = Path(f"/var/tmp/gpuctl-{kind}-{os.getpid()}")
    return base, client_key(base), f"{os.getpid()}o{lab_octet()}"


def lab_octet() -> int:
    """The third octet of this process's lab subnets. Under xdist: from the run's id and the
    worker's number (gw0, gw1, ...), so the workers of one run never share a subnet; else from the
    pid. Concurrent runs (CI beside a developer's) most likely differ (one of 250)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        run = int(hashlib.sha256(os.environ.get("PYTEST_XDIST_TESTRUNUID", "").encode()).hexdigest(), 16)
        return (run % 25) * 10 + int(worker[2:]) % 10
    return os.getpid() % 250


def tag_octet(tag: str) -> int:
    """The octet a lab's tag names: "<pid>o<octet>" (prepare), else its digits (older tags, bench)."""
    _, _, octet = tag.partition("o")
    return int(octet) if octet.isdigit() else int("".join(c for c in tag if c.isdigit()) or "0") % 250


def client_key(base: Path) -> Path:
    key = base / "client_ed25519"
    if not key.exists():
        base.mkdir(parents=True, exist_ok=True)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
    os.chmod(key, 0o600)
    return key


def available() -> str | None:
    """Why test hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "the SSH test hosts need root (network and mount namespaces); run the tests as root"
    for tool in ("ip", "unshare", "nsenter", "ssh-keygen", "/usr/sbin/sshd", "rsync"):
        if not shutil.which(tool):
            return f"{tool} is missing: ./scripts/test installs it"
    return None


def gpuctl_tmux(host, root: str = ROOT) -> str:
    """`tmux -L SOCKET` for the gpuctl cluster working in `root` on the host (its watchdog's config
    names the cluster's own tmux server)."""
    cfg = json.loads(host.run(f"cat {root}/guard/config.json").stdout)
    return f"tmux -L {cfg['tmux_socket']}"


def gpuctl_servers(host) -> list[str]:
    """The gpuctl tmux servers that run on the host (one per live cluster)."""
    out = host.run("for s in /tmp/tmux-0/gpuctl*; do tmux -S \"$s\" ls >/dev/null 2>&1 && echo \"${s##*/}\"; done").stdout
    return out.split()


def tcp_reachable(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """A TCP connection to host:port opens within timeout_s (a lab's routes, as seen from here)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
