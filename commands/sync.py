"""`hsx sync`: upload a directory (training checkpoints, logs) to a destination, pass after pass,
each file whose bytes the destination does not hold yet, verified (hsx/storage/destinations/).
Upload only: a file deleted here stays there. This module knows directories and the destination
interface; not NATS, not jobs.
"""

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from hsx.commands.configs import SyncConfig
from hsx.config.values import parse_duration  # noqa: F401 - `hsx sync --every`'s, named here too
from hsx.exitcodes import DONE, JOB_FAILED, STOPPED
from hsx.storage.destinations import Destination, error_line, file_sha256, store_errors
from hsx.storage.location import open_destination
from hsx.wire.lifecycle import stop_flag_on_signals

log = structlog.get_logger("hsx.sync")


@dataclass(frozen=True, slots=True)
class _Uploaded:
    """A file as it was when its bytes were last known to be in the destination."""

    size: int
    mtime_ns: int
    sha256: str


@dataclass
class PassResult:
    uploaded: list[str] = field(default_factory=list)
    unchanged: int = 0
    failed: list[str] = field(default_factory=list)
    bytes_uploaded: int = 0
    stopped: bool = False  # a signal ended the pass before every file was seen


class _FileChanged(Exception):
    """The file's size or mtime moved while it was hashed and uploaded."""


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _files(source: Path):
    """(key, path) of every regular file under source, in a stable order; symlinked dirs not followed."""

    def unreadable(exc: OSError) -> None:  # a directory we cannot list is said, not skipped silently
        log.warning("sync_directory_unreadable", path=exc.filename, error=exc.strerror)

    for root, dirs, names in os.walk(source, onerror=unreadable):
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            if path.is_file():
                yield path.relative_to(source).as_posix(), path


class Syncer:
    """One directory to one destination; remembers what it uploaded between passes."""

    def __init__(self, cfg: SyncConfig, dest: Destination, stopping: threading.Event) -> None:
        self.cfg, self.dest, self.stopping = cfg, dest, stopping
        self.known: dict[str, _Uploaded] = {}

    def run_pass(self) -> PassResult:
        result = PassResult()
        started = time.monotonic()
        for key, path in _files(self.cfg.source):
            if self.stopping.is_set():
                result.stopped = True
                break
            try:
                outcome, size = self._sync_file(key, path)
            except FileNotFoundError:
                log.info("sync_file_vanished", key=key)  # deleted between the listing and now: nothing to do
                continue
            if outcome == "uploaded":
                result.uploaded.append(key)
                result.bytes_uploaded += size
            elif outcome == "unchanged":
                result.unchanged += 1
            else:
                result.failed.append(key)
        log.info(
            "sync_pass_done",
            source=str(self.cfg.source),
            dest=self.dest.url,
            uploaded=len(result.uploaded),
            unchanged=result.unchanged,
            failed=len(result.failed),
            bytes_uploaded=result.bytes_uploaded,
            seconds=round(time.monotonic() - started, 2),
            stopped=result.stopped,
        )
        return result

    def _sync_file(self, key: str, path: Path) -> tuple[str, int]:
        """("uploaded" | "unchanged" | "failed", size); FileNotFoundError when the file is gone."""
        size, mtime_ns = _stat(path)
        known = self.known.get(key)
        if known is not None and (known.size, known.mtime_ns) == (size, mtime_ns):
            return "unchanged", size
        for attempt in range(1, self.cfg.retries + 1):
            try:
                return self._attempt(key, path, known)
            except FileNotFoundError:
                raise
            except (*store_errors(), _FileChanged) as exc:
                error = error_line(exc)
                if attempt == self.cfg.retries or self.stopping.is_set():
                    log.error("sync_file_failed", key=key, attempts=attempt, error=error)
                    return "failed", size
                delay = min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** (attempt - 1))
                log.warning("sync_upload_retry", key=key, attempt=attempt, retry_in_s=delay, error=error)
                if self.stopping.wait(delay):
                    log.error("sync_file_failed", key=key, attempts=attempt, error=error, reason="stopping")
                    return "failed", size
        raise AssertionError("unreachable")

    def _attempt(self, key: str, path: Path, known: _Uploaded | None) -> tuple[str, int]:
        """Hash the file as it is now; upload it unless the destination already holds those bytes
        (known from an earlier pass, else asked); raise _FileChanged if it moved meanwhile."""
        started = time.monotonic()
        stat = _stat(path)
        sha256 = file_sha256(path)
        if known is not None:
            there = (known.size, known.sha256) == (stat[0], sha256)  # touched, same bytes
        else:
            there = self.dest.has_sha256(key, size=stat[0], sha256=sha256)  # from an earlier process
        if not there:
            self.dest.put_file_verified(path, key, size=stat[0], sha256=sha256)
        if _stat(path) != stat:
            raise _FileChanged("it changed while it was hashed or uploaded (still being written?)")
        self.known[key] = _Uploaded(stat[0], stat[1], sha256)
        if there:
            return "unchanged", stat[0]
        log.info(
            "sync_file_uploaded",
            key=key,
            bytes=stat[0],
            sha256=sha256[:16],
            seconds=round(time.monotonic() - started, 3),
        )
        return "uploaded", stat[0]


def run_sync(cfg: SyncConfig) -> int:
    """Pass after pass until a signal (STOPPED: it never finishes on its own, and running it again
    is safe); with --once, one pass: DONE, or JOB_FAILED if a file failed its retries."""
    stopping = stop_flag_on_signals()
    syncer = Syncer(cfg, open_destination(cfg.dest, max_connections=8), stopping)
    log.info("sync_started", source=str(cfg.source), dest=syncer.dest.url, every_s=cfg.every_s)
    while True:
        started = time.monotonic()
        result = syncer.run_pass()
        if cfg.every_s is None:
            if stopping.is_set():  # the pass was cut short: the rest is synced by the next run
                log.info("sync_stopped", source=str(cfg.source), dest=syncer.dest.url)
                return STOPPED
            return JOB_FAILED if result.failed else DONE
        if stopping.wait(max(0.0, started + cfg.every_s - time.monotonic())):
            log.info("sync_stopped", source=str(cfg.source), dest=syncer.dest.url)
            return STOPPED
