"""SshHost's rules around SFTP. makedirs is `mkdir -p` over SFTP: a directory another push made
between its look and its mkdir (eight syncs of one project at once, each making code/NAME) is no
error; a mkdir that fails with nothing there is. A look whose connection drops is a lost host, one
past its deadline a hung host, never an internal error or an unreadable file. The SFTP client is
a stand-in: what is tested is the rule around it (the race itself is in
test_push_pull_safety.py, on a real sshd; a connection dropped for real in test_spot_recovery.py)."""

import stat
from types import SimpleNamespace

import pytest

from gpuctl.errors import RemoteError
from gpuctl.remote.ssh.host import SshHost


class RacingSftp:
    """No /w/code at the look; at the mkdir, another push has just made it (or, with `made`
    False, nothing is there and the server said Failure)."""

    def __init__(self, made: bool):
        self.made, self.dirs = made, {"/w"}

    def stat(self, path):
        if path in self.dirs:
            return SimpleNamespace(st_mode=stat.S_IFDIR | 0o755)
        raise FileNotFoundError(path)

    def mkdir(self, path):
        if self.made:
            self.dirs.add(path)  # the other push won
        raise OSError("Failure")  # what an SFTP server says for a mkdir of an existing directory


def host(sftp):
    fake = SimpleNamespace(sftp=sftp, label="root@box:22", command_timeout_s=30.0)
    fake._is_dir = lambda path: SshHost._is_dir(fake, path)
    return fake


def test_a_directory_made_meanwhile_by_another_push_is_no_error():
    SshHost.makedirs(host(RacingSftp(made=True)), "/w/code")


def test_a_mkdir_that_fails_with_nothing_there_still_says_so():
    with pytest.raises(RemoteError, match="cannot create /w/code on root@box:22"):
        SshHost.makedirs(host(RacingSftp(made=False)), "/w/code")


class DroppedSftp:
    """The connection went under the call (a spot instance taken away mid-look)."""

    def stat(self, path):
        import paramiko

        raise paramiko.SSHException("Server connection dropped: ")


def test_a_connection_dropped_under_an_sftp_look_is_a_lost_host_not_an_internal_error():
    """file_size (epochs.jsonl's size, at every look of a run) let paramiko's exception through:
    `train --wait` following a run whose instance was taken ended in an internal error."""
    fake = host(DroppedSftp())
    fake._lost = lambda exc: SshHost._lost(fake, exc)
    fake._sftp_call = lambda what: SshHost._sftp_call(fake, what)
    fake._absent = lambda exc, what: SshHost._absent(fake, exc, what)
    with pytest.raises(RemoteError, match="lost the connection to root@box:22"):
        SshHost.file_size(fake, "/w/runs/r/epochs.jsonl")


class SlowSftp:
    def stat(self, path):
        import socket

        raise socket.timeout("timed out")


def test_an_sftp_look_past_its_deadline_is_the_hosts_timeout_not_an_unreadable_file():
    from gpuctl.errors import RemoteTimeout, UnreadableFile

    fake = host(SlowSftp())
    fake._sftp_call = lambda what: SshHost._sftp_call(fake, what)
    fake._absent = lambda exc, what: SshHost._absent(fake, exc, what)
    fake.timed_out = lambda what, seconds: RemoteTimeout(f"{what} did not finish within {seconds:g} s")
    with pytest.raises(RemoteTimeout) as caught:
        SshHost.file_size(fake, "/w/runs/r/epochs.jsonl")
    assert not isinstance(caught.value, UnreadableFile)
