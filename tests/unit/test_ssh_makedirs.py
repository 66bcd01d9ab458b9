"""SshHost.makedirs is `mkdir -p` over SFTP: a directory another push made between its look and
its mkdir (eight syncs of one project at once, each making code/NAME) is no error; a mkdir that
fails with nothing there is. The SFTP client is a stand-in: what is tested is the rule around it
(the race itself is in test_push_pull_safety.py, on a real sshd)."""

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
