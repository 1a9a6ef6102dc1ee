"""`file:///dir` (or a plain path): a folder on this machine's file systems (a local disk, or a
mount such as NFS or Lustre). Files are copied into place atomically (temp file, fsync, rename)
and read back to verify; a spool file on the same file system is renamed instead of copied
(`move_verified`). Free space is asked of the file system (`local_folder`).

Design notes: docs/architecture/storage.md.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import SplitResult, unquote

from hsx.errors import HsxError
from hsx.storage.destinations.base import Destination, Scheme, VerificationError, file_sha256, one_line
from hsx.storage.fsutil import atomic_copy, atomic_write_bytes, fsync_dir, make_private_dirs
from hsx.storage.samplefile import DigestCheck, SampleFileCorrupt, checked_file_digest

# Errors that stay until someone acts: permissions, a read-only or full file system, a file where
# a directory of the destination belongs.
_REFUSALS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR}
_REFUSALS_ANYWHERE = {errno.EROFS, errno.ENOSPC, errno.EDQUOT}  # os.write names no file


class FolderSync:
    """Group commit of folder fsyncs: `sync(folder)` returns once an fsync of `folder` that began
    after the call has ended, so every rename into it made before the call is durable. Callers
    that arrive while one runs share the next: many renames, few fsyncs (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._asked: dict[Path, int] = {}  # per folder: syncs asked for so far
        self._done: dict[Path, int] = {}  # per folder: syncs asked for before the last one that ended began
        self._running: set[Path] = set()

    def sync(self, folder: Path) -> None:
        with self._lock:
            mine = self._asked[folder] = self._asked.get(folder, 0) + 1
            while self._done.get(folder, 0) < mine:
                if folder in self._running:
                    self._lock.wait()
                    continue
                self._running.add(folder)
                covers = self._asked[folder]
                self._lock.release()
                try:
                    fsync_dir(folder)
                finally:
                    self._lock.acquire()
                    self._running.discard(folder)
                    self._lock.notify_all()
                self._done[folder] = max(self._done.get(folder, 0), covers)


class FileDestination:
    latency_bound = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.as_uri()
        self._folders = FolderSync()
        self._devices: dict[Path, int] = {}  # folder -> st_dev, for move_verified

    def move_verified(self, local: Path, key: str, *, size: int, checked: os.stat_result) -> bool:
        """Store the spool file `local` under `key` by renaming it, when both are on one file
        system; False, with nothing done, when they are not (the caller copies instead).

        `checked` is the local file's fstat taken while the caller checked its bytes against the
        announced digest: the stored file must be that inode (spool files are only ever replaced,
        never written in place, so the inode's bytes are the checked ones) with `size` bytes.
        The consumer fsynced those bytes; the rename is durable once its folder is fsynced, which
        concurrent moves into the folder share. FileNotFoundError if `local` is gone meanwhile."""
        final = self._path(key)
        folder = final.parent
        make_private_dirs(folder)
        device = self._devices.get(folder)
        if device is None:
            device = self._devices[folder] = folder.stat().st_dev
        if device != checked.st_dev:
            return False
        os.rename(local, final)
        stored = final.stat()
        if (stored.st_ino, stored.st_size) != (checked.st_ino, size):
            raise VerificationError(
                f"{key}: the file renamed into place (inode {stored.st_ino}, {stored.st_size} bytes) is not the one "
                f"checked (inode {checked.st_ino}, {size} bytes): it was replaced meanwhile"
            )
        self._folders.sync(folder)
        return True

    def _path(self, key: str) -> Path:
        return self.root / key

    def put_verified(self, local: Path, key: str, *, size: int, digest: str) -> None:
        check = DigestCheck()  # the bytes copied are checked in the same pass
        atomic_copy(local, self._path(key), observe=check.update)
        stored_size = self._path(key).stat().st_size
        try:
            written = check.result()
        except SampleFileCorrupt as exc:
            written = f"corrupt ({exc})"
        if written != digest or stored_size != size:
            raise VerificationError(
                f"{key}: stored {stored_size} bytes with digest {written[:80]}, expected {size} bytes {digest[:12]}"
            )

    def has_verified(self, key: str, *, size: int, digest: str) -> bool:
        path = self._path(key)
        try:
            if path.stat().st_size != size:
                return False
            return checked_file_digest(path) == digest
        except (FileNotFoundError, SampleFileCorrupt):
            return False

    def put_bytes_verified(self, data: bytes, key: str) -> None:
        atomic_write_bytes(self._path(key), data)
        if not self.has_sha256(key, size=len(data), sha256=hashlib.sha256(data).hexdigest()):
            raise VerificationError(f"{key}: the stored file does not hold the bytes written")

    def put_file_verified(self, local: Path, key: str, *, size: int, sha256: str) -> None:
        copied = hashlib.sha256()  # the bytes copied, hashed in the same pass: a file that changed
        count = 0  # since the caller hashed it is caught here, not stored silently

        def observe(chunk: memoryview) -> None:
            nonlocal count
            copied.update(chunk)
            count += len(chunk)

        atomic_copy(local, self._path(key), observe=observe)
        if (count, copied.hexdigest()) != (size, sha256):
            raise VerificationError(
                f"{key}: copied {count} bytes with sha256 {copied.hexdigest()[:12]}, expected {size} bytes "
                f"{sha256[:12]} (did {local} change while it was copied?)"
            )

    def has_sha256(self, key: str, *, size: int, sha256: str) -> bool:
        path = self._path(key)
        try:
            return path.stat().st_size == size and file_sha256(path) == sha256
        except FileNotFoundError:
            return False

    def read_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def open_read(self, key: str) -> BinaryIO:
        return open(self._path(key), "rb")

    def read_prefix(self, key: str, length: int) -> tuple[bytes, int]:
        with open(self._path(key), "rb") as source:
            return source.read(length), os.fstat(source.fileno()).st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self) -> Iterator[str]:
        if not self.root.exists():
            return
        for path in sorted(self.root.rglob("*.safetensors")):
            if not path.name.startswith("."):
                yield path.relative_to(self.root).as_posix()

    def refusal(self, exc: BaseException) -> str | None:
        """A refusal only when the error is the destination's: a spool file the uploader cannot
        read is not the destination refusing."""
        if not isinstance(exc, OSError) or exc.errno not in _REFUSALS:
            return None
        named = [Path(name) for name in (exc.filename, exc.filename2) if name]
        if any(path.is_relative_to(self.root) for path in named) or (not named and exc.errno in _REFUSALS_ANYWHERE):
            where = f" ({named[0]})" if named else ""
            return one_line(f"{self.url}: {exc.strerror or os.strerror(exc.errno)}{where}")
        return None

    def reconnect(self) -> None:
        """Nothing to reopen: every call goes to the file system afresh."""


@dataclass(frozen=True, kw_only=True)
class FileScheme(Scheme):
    """A Location of it has no bucket and an absolute, normalised local path."""

    def parse(self, url: str, split: SplitResult, *, what: str) -> tuple[str, str]:
        if split.netloc not in ("", "localhost"):
            raise HsxError(f"{what} {url!r}: file:// URLs must be local (file:///absolute/dir)")
        if not split.path.startswith("/"):
            raise HsxError(f"{what} {url!r}: a file:// URL needs an absolute path (file:///absolute/dir)")
        return "", str(Path(unquote(split.path)))

    def url(self, bucket: str, path: str) -> str:
        return Path(path).as_uri()

    def child(self, path: str, name: str) -> str:
        return str(Path(path, name))

    def suggestion(self, rest: str) -> str:
        return f"file:///{rest}"

    def local_folder(self, path: str) -> Path | None:
        return Path(path)

    def open(self, bucket: str, path: str, *, max_connections: int) -> Destination:
        return FileDestination(Path(path))


FILE = FileScheme(name="file", form="file:///dir")
