"""What the page and dashboard tests need from this machine: Debian's chromium and prometheus,
installed with apt-get when missing (as tests/compose/run.py installs Docker), and a headless
Chromium driven by Playwright over the DevTools protocol (never `playwright install`, which would
download a browser of its own).

Playwright's sync API runs an event loop of its own in the thread that starts it, and the `hsx`
fixture runs commands in the test's thread with asyncio.run: so the browser lives on a thread of
its own (`Browser`), and each call is handed to it.
"""

import concurrent.futures
import fcntl
import os
import queue
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
# What Chromium needs to start here and stay off the network (a closed network refuses its
# background connections, many at a time).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
]
# One apt-get at a time on this machine (pytest-xdist runs the page and dashboard tests at once).
_APT_LOCK = Path("/tmp/hsx-tests-apt.lock")


def ensure_installed(binary: str, package: str) -> str:
    """The path of `binary`, installing Debian's `package` first when it is missing (as root);
    the test fails in one line naming the package when it cannot be installed."""
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0:
        pytest.fail(f"{binary} is missing and this user cannot install it: apt-get install {package}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with open(_APT_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not shutil.which(binary):
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
            proc = subprocess.run(
                ["apt-get", "install", "-y", "-q", package], env=env, capture_output=True, text=True, timeout=900
            )
            if proc.returncode != 0 or not shutil.which(binary):
                last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
                pytest.fail(f"apt-get install {package} failed: {last}")
    return shutil.which(binary)


class Browser(threading.Thread):
    """A headless Chromium on its own thread; `call(fn)` runs `fn(page)` there and returns its result."""

    def __init__(self, *, width: int = 1400, height: int = 1300) -> None:
        super().__init__(daemon=True, name="chromium")
        self.width, self.height = width, height
        self._calls: queue.Queue = queue.Queue()
        self._ready = concurrent.futures.Future()
        self.start()
        self._ready.result(timeout=120)

    def run(self) -> None:
        from playwright.sync_api import sync_playwright

        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                # bypass_csp: the page forbids evaluated scripts (its Content-Security-Policy);
                # the test's own reads of the DOM are evaluated.
                context = browser.new_context(bypass_csp=True, viewport={"width": self.width, "height": self.height})
                page = context.new_page()
                self._ready.set_result(True)
                while True:
                    item = self._calls.get()
                    if item is None:
                        break
                    fn, future = item
                    try:
                        future.set_result(fn(page))
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        future.set_exception(exc)
                browser.close()
        except BaseException as exc:  # noqa: BLE001 - a browser that cannot start fails the test that asked
            if not self._ready.done():
                self._ready.set_exception(exc)

    def call(self, fn: Callable, timeout: float = 60):
        future = concurrent.futures.Future()
        self._calls.put((fn, future))
        return future.result(timeout=timeout)

    def evaluate(self, script: str, *, tries: int = 20):
        """`script`'s value in the page; asked again while a navigation replaces the page (its
        old document's context is gone before the new one exists)."""
        from playwright.sync_api import Error

        for attempt in range(tries):
            try:
                return self.call(lambda page: page.evaluate(script))
            except Error as exc:
                if "context was destroyed" not in str(exc) and "navigat" not in str(exc) or attempt == tries - 1:
                    raise
                self.call(lambda page: page.wait_for_load_state())

    def close(self) -> None:
        self._calls.put(None)
        self.join(timeout=30)


# The page's numbers: each [data-field] element's exact value (data-value), by field, and "as_of"
# the time of the reading they come from. One evaluation, so one draw: a draw between two reads
# would pair one reading's numbers with the next one's time.
READ_FIELDS = """() => Object.assign(Object.fromEntries(
  [...document.querySelectorAll('[data-field]')].map(el => [el.dataset.field, el.dataset.value])),
  {as_of: document.body.dataset.asOf || '0'})"""
