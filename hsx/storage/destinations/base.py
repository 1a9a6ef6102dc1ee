"""What a destination is, whatever store holds its files: the `Destination` protocol (the verified
puts, the reads, the listing and the error wording that the uploader, the producer, the readers,
`hsx verify`, `hsx export` and `hsx sync` call), the errors every destination raises, and
`Scheme`: one kind of store as the registry (hsx/storage/destinations/__init__.py) knows it, by
its URL scheme, with how its URLs are parsed and written, what the store can and cannot tell
(free space) and how it is opened. `ObjectStore` is the family base of the schemes whose URLs
name a bucket and a key prefix (`s3://`, `az://`).

It knows no store's client library: each store is a module of its own (file, s3, azure) that
imports its client when a destination is opened, never at import.

Design notes: docs/architecture/storage.md.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal, Protocol
from urllib.parse import SplitResult

from hsx.errors import HsxError

_HASH_CHUNK = 8 << 20
_REASON_CHARS = 300  # a refusal's reason is cut to this: it travels in heartbeats and status lines


class VerificationError(Exception):
    """The stored object is not what was sent; the upload is retried."""


class Destination(Protocol):
    """One folder of one store (a local directory, a bucket's key prefix), opened. Calls block;
    the uploader runs them on worker threads. Keys are relative to the folder, `/`-separated.
    A read of a key that holds nothing raises FileNotFoundError, in every store."""

    url: str
    latency_bound: bool  # throughput comes from many requests in flight (remote object stores)

    def put_verified(self, local: Path, key: str, *, size: int, digest: str) -> None:
        """Store the sample file `local` under `key`; returns once the stored object is known to
        have `size` bytes and the sample-file digest `digest`, else VerificationError."""

    def has_verified(self, key: str, *, size: int, digest: str) -> bool:
        """Whether `key` already holds exactly that sample file (a redelivered upload is acked)."""

    def move_verified(self, local: Path, key: str, *, size: int, checked: os.stat_result) -> bool:
        """Store `local` by renaming it where the store can (a folder on the spool's own file
        system); False, with nothing done, where it cannot: the caller puts instead."""

    def put_bytes_verified(self, data: bytes, key: str) -> None: ...

    def put_file_verified(self, local: Path, key: str, *, size: int, sha256: str) -> None: ...

    def has_sha256(self, key: str, *, size: int, sha256: str) -> bool: ...

    def read_bytes(self, key: str) -> bytes: ...

    def open_read(self, key: str) -> BinaryIO:
        """The object as a stream, for one read front to back in bounded memory."""

    def read_prefix(self, key: str, length: int) -> tuple[bytes, int]:
        """The first `length` bytes (fewer if the object is shorter) and the object's size."""

    def delete(self, key: str) -> None:
        """Delete `key`; a key that holds nothing is no error."""

    def keys(self) -> Iterator[str]: ...

    def refusal(self, exc: BaseException) -> str | None:
        """One line naming the destination, with no secret in it, when `exc` is an error no retry
        fixes until a person acts (permissions, credentials, a missing bucket); else None."""

    def reconnect(self) -> None:
        """A fresh client: credentials fixed meanwhile are read again."""


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks (checkpoints are larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def one_line(text: str) -> str:
    """`text` on one line, cut to what a heartbeat and a status line carry."""
    return " ".join(text.split())[:_REASON_CHARS]


def redacted(text: str, secrets: list[str]) -> str:
    """`text` with each secret of eight characters or more replaced by ***, on one line."""
    for secret in secrets:
        if len(secret) >= 8:
            text = text.replace(secret, "***")
    return one_line(text)


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """One kind of store, named by its URL scheme: what a Location (hsx/storage/location.py) of
    it holds (`bucket`: the host part of the URL, "" for a local folder; `path`: a key prefix or
    an absolute local path), how it is written back as a URL, and how it is opened."""

    name: str  # the URL scheme, the registry's key: `s3` of s3://bucket/prefix
    form: str  # how --dest's help and errors show it: "s3://bucket/prefix"
    # Variables its client reads itself, each with what its value is, for `hsx config show`:
    # "secret" (never shown), "url" (shown without its password) or "text".
    environment: Mapping[str, Literal["secret", "url", "text"]] = field(default_factory=dict)

    def parse(self, url: str, split: SplitResult, *, what: str) -> tuple[str, str]:
        """(bucket, path) of a URL of this scheme; a one-line HsxError naming `what` otherwise."""
        raise NotImplementedError

    def url(self, bucket: str, path: str) -> str:
        """The canonical URL: what job specs, logs and errors carry, and parse gives back."""
        raise NotImplementedError

    def child(self, path: str, name: str) -> str:
        """The path of `<path>/<name>`."""
        raise NotImplementedError

    def suggestion(self, rest: str) -> str:
        """A URL of this scheme for `rest`, the text after a mistyped scheme."""
        return f"{self.name}://{rest}"

    def local_folder(self, path: str) -> Path | None:
        """The folder on this machine that holds the files, whose file system has a free space to
        ask and can hold the spool; None for a remote store."""
        return None

    def open(self, bucket: str, path: str, *, max_connections: int) -> Destination:
        """The destination, with a client for up to `max_connections` requests at once."""
        raise NotImplementedError

    def client_errors(self) -> tuple[type[BaseException], ...]:
        """What its client raises when the store fails, after the client's own retries (besides
        OSError and VerificationError); () when its client library is not installed."""
        return ()


@dataclass(frozen=True, kw_only=True)
class ObjectStore(Scheme):
    """A store whose URLs are `<scheme>://<bucket>/<key prefix>`: the prefix has no slash at
    either end, "" for the bucket's root."""

    called: str  # how an error names a destination of it: "an S3 destination"
    bucket_word: str = "bucket"  # what the store calls the URL's host part, in errors
    bucket_form: str = ""  # a regular expression a bucket name must match ("": any)
    bucket_rule: str = ""  # that rule in words, for the error

    def parse(self, url: str, split: SplitResult, *, what: str) -> tuple[str, str]:
        if not split.netloc:
            raise HsxError(f"{what} {url!r}: {self.called} needs a {self.bucket_word}, e.g. {self.form}")
        if self.bucket_form and not re.fullmatch(self.bucket_form, split.netloc):
            raise HsxError(f"{what} {url!r}: {split.netloc!r} is not a {self.bucket_word} name ({self.bucket_rule})")
        return split.netloc, split.path.strip("/")

    def url(self, bucket: str, path: str) -> str:
        return f"{self.name}://{bucket}/{path}" if path else f"{self.name}://{bucket}"

    def child(self, path: str, name: str) -> str:
        return f"{path}/{name}" if path else name
