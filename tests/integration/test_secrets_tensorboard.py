"""TensorBoard, which has no authentication of its own, answers only this user: another user of
this machine (`runuser -u nobody`) gets 403 on its port, this user gets the page with the URL
`gpuctl tensorboard` printed (its token, then the cookie it sets). Local provider, real TensorBoard;
over SSH, the same on the host and on the forwarded port: test_ssh.py.

Bad inputs tried (test_tensorboard_guard.py): no token, a wrong one, an empty one, a cookie of
another name or a wrong value, a malformed cookie header, the token less its last character."""

from __future__ import annotations

import http.cookiejar
import os
import re
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.tf  # a real TensorBoard, which loads TensorFlow: ~15 s


def as_nobody(port: int, path: str = "/", netns: list[str] | None = None) -> str:
    """The status line another user of the machine gets (bash's /dev/tcp: nothing to install)."""
    script = (f'exec 3<>/dev/tcp/127.0.0.1/{port} && printf "GET {path} HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n" >&3 '
              '&& head -1 <&3')
    return subprocess.run([*(netns or []), "runuser", "-u", "nobody", "--", "bash", "-c", script],
                          capture_output=True, text=True, timeout=20).stdout.strip()


def owner_gets_the_page(url: str) -> None:
    """This user with the printed URL: the page, and TensorBoard's data with the cookie it set."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    with opener.open(url, timeout=10) as resp:
        assert resp.status == 200 and "token=" not in resp.url and b"<tb-webapp>" in resp.read()
    base = url.split("?")[0]
    with opener.open(base + "data/environment", timeout=10) as resp:
        assert resp.status == 200
    with pytest.raises(urllib.error.HTTPError) as err:  # without the cookie or the token
        urllib.request.urlopen(base + "data/environment", timeout=10)
    assert err.value.code == 403


def start(port: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "tensorboard", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # printed once TensorBoard serves
    m = re.search(r"http://127\.0\.0\.1:\d+/\?token=[\w-]+", line)
    assert m, line + proc.stderr.read() if proc.poll() is not None else line
    return proc, m.group(0)


def test_local_tensorboard_answers_this_user_only(gpuctl, isolated):
    gpuctl("up", "--provider", "local")
    proc, url = start(16141)
    try:
        assert as_nobody(16141).split()[1:2] == ["403"], as_nobody(16141)
        assert as_nobody(16141, "/data/environment").split()[1:2] == ["403"]
        owner_gets_the_page(url)
        # The token is in a file of this user's alone, not in TensorBoard's argv or environment.
        token = url.rsplit("=", 1)[1]
        tb = isolated / "clusters" / "default" / "tensorboard"
        assert stat.S_IMODE(os.stat(tb).st_mode) == 0o700 and (tb / "token").read_text() == token
        for pid in Path("/proc").glob("[0-9]*"):
            try:
                seen = (pid / "cmdline").read_bytes() + (pid / "environ").read_bytes()
            except OSError:
                continue
            assert token.encode() not in seen, (pid / "cmdline").read_bytes()
    finally:
        proc.terminate()
        proc.wait(10)
    # A second `gpuctl tensorboard` finds it serving and prints the same token.
    proc, again = start(16141)
    proc.terminate()
    proc.wait(10)
    assert again == url
    gpuctl("down", "-y")
