"""Where finished sample files end up: `file:///dir` (or a plain path) and `s3://bucket/prefix`.

One small interface: `put_verified` copies a local file to a key and returns only once the stored
object is known to have the expected size and digest (hsx.samplefile); `has_verified` answers whether a key already
holds exactly that object (a redelivered upload is then acked without re-uploading). Calls block;
the uploader runs them on worker threads.

Files that are not sample files (the job bundle the producer writes under `<job>/_hsx/`, the
directories `hsx sync` uploads) go through `put_bytes_verified` / `put_file_verified` and
`has_sha256`: the same verified put, checked by size and the sha256 of the whole content (S3 user
metadata `hsx-sha256`; a file:// destination re-reads the stored file).

S3 settings come from the standard AWS variables (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION); a custom endpoint gets path-style
addressing, which MinIO, moto and most S3-compatible stores need.
"""

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

from hsx.errors import HsxError
from hsx.fsutil import atomic_copy, atomic_write_bytes
from hsx.samplefile import DigestCheck, SampleFileCorrupt, checked_file_digest

MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 64 << 20
DIGEST_METADATA = "hsx-digest"  # S3 user metadata: the sample file's digest, compared by has_verified
SHA256_METADATA = "hsx-sha256"  # S3 user metadata: sha256 of any other file's bytes, compared by has_sha256
_HASH_CHUNK = 8 << 20


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks (checkpoints are larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Destination(Protocol):
    url: str
    latency_bound: bool  # throughput comes from many requests in flight (remote object stores)

    def put_verified(self, local: Path, key: str, *, size: int, digest: str) -> None: ...

    def has_verified(self, key: str, *, size: int, digest: str) -> bool: ...

    def put_bytes_verified(self, data: bytes, key: str) -> None: ...

    def put_file_verified(self, local: Path, key: str, *, size: int, sha256: str) -> None: ...

    def has_sha256(self, key: str, *, size: int, sha256: str) -> bool: ...

    def read_bytes(self, key: str) -> bytes: ...

    def keys(self) -> Iterator[str]: ...


class VerificationError(Exception):
    """The stored object is not what was sent; the upload is retried."""


class FileDestination:
    latency_bound = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.as_uri()

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
        count = 0                  # since the caller hashed it is caught here, not stored silently

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

    def keys(self) -> Iterator[str]:
        if not self.root.exists():
            return
        for path in sorted(self.root.rglob("*.safetensors")):
            if not path.name.startswith("."):
                yield path.relative_to(self.root).as_posix()


def _custom_s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


class S3Destination:
    latency_bound = True

    def __init__(self, bucket: str, prefix: str, *, max_connections: int = 100) -> None:
        import boto3
        import botocore.config
        from boto3.s3.transfer import TransferConfig

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        endpoint = _custom_s3_endpoint()
        config = botocore.config.Config(
            s3={"addressing_style": "path" if endpoint else "auto"},
            max_pool_connections=max_connections + 4,
            retries={"max_attempts": 5, "mode": "standard"},
            connect_timeout=10,
            read_timeout=120,
        )
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
        # One file is one transfer; concurrency comes from the uploader running many at once.
        self.transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNK,
            max_concurrency=4, use_threads=True,
        )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_verified(self, local: Path, key: str, *, size: int, digest: str) -> None:
        full_key = self._key(key)
        metadata = {DIGEST_METADATA: digest}
        # The client sends a CRC32 of the body (cheap next to sha256) and the server refuses a
        # body that does not match it: the object is the local file, which the uploader checked.
        if size < MULTIPART_THRESHOLD:
            with open(local, "rb") as body:
                self.client.put_object(
                    Bucket=self.bucket, Key=full_key, Body=body, Metadata=metadata, ChecksumAlgorithm="CRC32",
                )
        else:
            self.client.upload_file(
                str(local), self.bucket, full_key,
                ExtraArgs={"Metadata": metadata, "ChecksumAlgorithm": "CRC32"}, Config=self.transfer,
            )
        if not self.has_verified(key, size=size, digest=digest):
            raise VerificationError(f"s3://{self.bucket}/{full_key}: stored object does not match the local file")

    def has_verified(self, key: str, *, size: int, digest: str) -> bool:
        head = self._head(key)
        return head is not None and head["ContentLength"] == size and head.get("Metadata", {}).get(DIGEST_METADATA) == digest

    def put_bytes_verified(self, data: bytes, key: str) -> None:
        sha256 = hashlib.sha256(data).hexdigest()
        self.client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=data, Metadata={SHA256_METADATA: sha256}, ChecksumAlgorithm="CRC32",
        )
        if not self.has_sha256(key, size=len(data), sha256=sha256):
            raise VerificationError(f"s3://{self.bucket}/{self._key(key)}: stored object does not match the bytes sent")

    def put_file_verified(self, local: Path, key: str, *, size: int, sha256: str) -> None:
        if size < MULTIPART_THRESHOLD:
            # Send exactly the bytes hashed here: a file that changed since the caller hashed it is
            # refused instead of stored under a sha256 it does not have.
            data = local.read_bytes()
            if (len(data), hashlib.sha256(data).hexdigest()) != (size, sha256):
                raise VerificationError(f"{local}: changed since it was hashed ({len(data)} bytes now, {size} expected)")
            self.put_bytes_verified(data, key)
            return
        # Multipart parts are read by the transfer's threads; a file that changes meanwhile is the
        # caller's to notice (hsx sync compares size and mtime before hashing and after the upload).
        self.client.upload_file(
            str(local), self.bucket, self._key(key),
            ExtraArgs={"Metadata": {SHA256_METADATA: sha256}, "ChecksumAlgorithm": "CRC32"}, Config=self.transfer,
        )
        if not self.has_sha256(key, size=size, sha256=sha256):
            raise VerificationError(f"s3://{self.bucket}/{self._key(key)}: stored object does not match {local}")

    def has_sha256(self, key: str, *, size: int, sha256: str) -> bool:
        head = self._head(key)
        return head is not None and head["ContentLength"] == size and head.get("Metadata", {}).get(SHA256_METADATA) == sha256

    def _head(self, key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def read_bytes(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def keys(self) -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        prefix = f"{self.prefix}/" if self.prefix else ""
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                yield obj["Key"][len(prefix):]


def parse_dest(url: str) -> str:
    """Normalise a --dest value; raise a one-line error for anything else."""
    if url.startswith("s3://"):
        split = urlsplit(url)
        if not split.netloc:
            raise HsxError(f"--dest {url!r}: an S3 destination needs a bucket, e.g. s3://bucket/prefix")
        return url.rstrip("/")
    if url.startswith("file://"):
        split = urlsplit(url)
        if split.netloc not in ("", "localhost"):
            raise HsxError(f"--dest {url!r}: file:// URLs must be local (file:///absolute/dir)")
        return Path(unquote(split.path)).as_uri()
    if "://" in url:
        raise HsxError(f"--dest {url!r}: unsupported scheme; use s3://bucket/prefix, file:///dir or a path")
    return Path(url).expanduser().resolve().as_uri()


def open_destination(url: str, *, max_connections: int = 100) -> Destination:
    url = parse_dest(url)
    split = urlsplit(url)
    if split.scheme == "s3":
        return S3Destination(split.netloc, split.path, max_connections=max_connections)
    return FileDestination(Path(unquote(split.path)))
