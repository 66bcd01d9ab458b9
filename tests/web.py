"""A real `gpuctl dashboard` for tests: started as its own process over the test's gpuctl home,
its URL read from what it prints, ended with SIGTERM; and headless Chromium from Debian's
packages driven by Playwright (its Python package with the system browser: no browser download)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.waits import wait_for

CHROMIUM = "/usr/bin/chromium"
# As the machine's probe found: without the background-networking flags Chromium reaches for
# Google's hosts at every start, which this closed network refuses, many at a time.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


class Served:
    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url
        parts = urllib.parse.urlsplit(url)
        self.base = f"{parts.scheme}://{parts.netloc}"
        self.port = parts.port
        self.token = urllib.parse.parse_qs(parts.fragment)["token"][0]


@contextmanager
def dashboard(home: Path, *flags: str, interval: float = 0.3) -> Iterator[Served]:
    # The test's environment (the `isolated` fixture dropped the caller's GPUCTL_* settings; a
    # test's own monkeypatched ones, such as a provider's, count), over the test's home.
    env = {**os.environ, "GPUCTL_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "dashboard", "--no-open", "--interval", str(interval),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "Dashboard: URL" once it listens (or nothing: it failed)
        if not line.startswith("Dashboard: "):
            proc.wait(timeout=30)
            raise AssertionError(f"gpuctl dashboard did not start: {line}{proc.stderr.read() if proc.stderr else ''}")
        yield Served(proc, line.split(" ", 1)[1].strip())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def chromium() -> Iterator[object]:
    """Headless Chromium (Debian's) under Playwright; a missing browser fails, saying why."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: the browser tests need Debian's chromium (scripts/test installs it)",
                    pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def text_of(page, selector: str) -> str:
    return page.locator(selector).inner_text()


__all__ = ["Served", "chromium", "dashboard", "text_of", "wait_for"]
