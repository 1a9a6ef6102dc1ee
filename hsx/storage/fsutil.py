"""Atomic file writes: temp file in the target directory, fsync, rename, fsync the directory.

A reader (the uploader, a trainer reading a file:// destination) sees either no file or the whole
file, never a prefix of one, whatever moment the writer dies at.
"""

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700
_CHUNK = 8 << 20


def make_private_dirs(path: Path) -> None:
    """Create path and any missing parents, each 0700 (mkdir(parents=True) gives parents 0777)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass


def fsync_dir(path: Path) -> None:
    """Make the names created in (or renamed into) `path` durable."""
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.tmp")


def atomic_write(final: Path, write: Callable[[int], None], *, sync_dir: bool = True) -> None:
    """Create `final` atomically: `write(fd)` fills a new temp file beside it (0600), which is then
    fsynced and renamed over `final`. A failure removes the temp file and leaves `final` as it was.
    `sync_dir=False` leaves the rename itself to the caller's `fsync_dir` of the folder (one for
    many files: the file is not durable under its name until then)."""
    make_private_dirs(final.parent)
    tmp = _temp_path(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        write(fd)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, final)
    if sync_dir:
        _fsync_dir(final.parent)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def atomic_write_bytes(final: Path, data: bytes | memoryview) -> None:
    atomic_write(final, lambda fd: _write_all(fd, data))


def atomic_copy(source: Path, final: Path, *, observe: Callable[[memoryview], None] | None = None) -> None:
    """Copy source to final atomically; `observe` sees every chunk copied, in order (to check the
    bytes written in the same pass)."""

    def copy(fd: int) -> None:
        with open(source, "rb") as src:
            buffer = bytearray(_CHUNK)
            while size := src.readinto(buffer):
                chunk = memoryview(buffer)[:size]
                if observe is not None:
                    observe(chunk)
                _write_all(fd, chunk)

    atomic_write(final, copy)


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
