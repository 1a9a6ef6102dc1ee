"""Atomic file writes: temp file in the target directory, fsync, rename, fsync the directory.

A reader (the uploader, a trainer reading a file:// destination) sees either no file or the whole
file, never a prefix of one, whatever moment the writer dies at.
"""

import hashlib
import os
import shutil
import uuid
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.tmp")


def atomic_write_bytes(final: Path, data: bytes | memoryview) -> None:
    make_private_dirs(final.parent)
    tmp = _temp_path(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def atomic_copy(source: Path, final: Path) -> str:
    """Copy source to final atomically; return the sha256 of the bytes written."""
    make_private_dirs(final.parent)
    tmp = _temp_path(final)
    digest = hashlib.sha256()
    try:
        with open(source, "rb") as src, open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as dst:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free
