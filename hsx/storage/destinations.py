"""Where finished files end up: `file:///dir` (or a plain path) and `s3://bucket/prefix`, behind
one `Destination` interface (`FileDestination`, `S3Destination`; `open_destination` picks one).
It holds the verified puts of sample files (`put_verified`, `has_verified`, `move_verified`) and
of other bytes (`put_bytes_verified`, `put_file_verified`, `has_sha256`), the producer's write
test (`probe`), and each destination's own errors (`refusal`, `reconnect`). Calls block.

Design notes: docs/architecture/storage.md.
"""

import errno
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from hsx.storage.fsutil import (
    atomic_copy,
    atomic_write_bytes,
    fsync_dir,
    make_private_dirs,
)
from hsx.storage.location import Location
from hsx.storage.samplefile import DigestCheck, SampleFileCorrupt, checked_file_digest

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

    def move_verified(self, local: Path, key: str, *, size: int, checked: os.stat_result) -> bool: ...

    def put_bytes_verified(self, data: bytes, key: str) -> None: ...

    def put_file_verified(self, local: Path, key: str, *, size: int, sha256: str) -> None: ...

    def has_sha256(self, key: str, *, size: int, sha256: str) -> bool: ...

    def read_bytes(self, key: str) -> bytes: ...

    def open_read(self, key: str) -> BinaryIO: ...

    def read_prefix(self, key: str, length: int) -> tuple[bytes, int]: ...

    def delete(self, key: str) -> None: ...

    def keys(self) -> Iterator[str]: ...

    def refusal(self, exc: BaseException) -> str | None: ...

    def reconnect(self) -> None: ...


_REASON_CHARS = 300  # a refusal's reason is cut to this: it travels in heartbeats and status lines

# file:// errors that stay until someone acts: permissions, a read-only or full file system, a
# file where a directory of the destination belongs.
_FILE_REFUSALS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EISDIR}
_FILE_REFUSALS_ANYWHERE = {errno.EROFS, errno.ENOSPC, errno.EDQUOT}  # os.write names no file

# S3 error codes no retry fixes: the bucket, the credentials, the clock or the permissions must
# change first.
_S3_REFUSALS = {
    "NoSuchBucket",
    "AccessDenied",
    "AllAccessDisabled",
    "AccountProblem",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidBucketName",
    "NotSignedUp",
    "AuthorizationHeaderMalformed",
    "InvalidSecurity",
    "RequestTimeTooSkewed",
    "RequestExpired",
    "PermanentRedirect",
    "InvalidPayer",
    "UnauthorizedAccess",
}
_S3_REFUSAL_STATUS = {401, 403}  # a response without a body to name its error (HEAD) says only this
_S3_HINTS = {
    "AccessDenied": "the uploader needs s3:PutObject, s3:GetObject and s3:ListBucket on the prefix",
    "403": "a HEAD refusal carries no reason: wrong key or secret, an expired token, or a missing permission",
}


def _one_line(text: str) -> str:
    return " ".join(text.split())[:_REASON_CHARS]


class VerificationError(Exception):
    """The stored object is not what was sent; the upload is retried."""


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
        """The file as a stream, for one read front to back in bounded memory."""
        return open(self._path(key), "rb")

    def read_prefix(self, key: str, length: int) -> tuple[bytes, int]:
        """The first `length` bytes (fewer if the file is shorter) and the file's size."""
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
        if not isinstance(exc, OSError) or exc.errno not in _FILE_REFUSALS:
            return None
        named = [Path(name) for name in (exc.filename, exc.filename2) if name]
        if any(path.is_relative_to(self.root) for path in named) or (
            not named and exc.errno in _FILE_REFUSALS_ANYWHERE
        ):
            where = f" ({named[0]})" if named else ""
            return _one_line(f"{self.url}: {exc.strerror or os.strerror(exc.errno)}{where}")
        return None

    def reconnect(self) -> None:
        """Nothing to reopen: every call goes to the file system afresh."""


def _custom_s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


class S3Destination:
    latency_bound = True

    def __init__(self, bucket: str, prefix: str, *, max_connections: int = 100) -> None:
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
        self._endpoint, self._config = endpoint, config
        self.reconnect()
        # One file is one transfer; concurrency comes from the uploader running many at once.
        self.transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD,
            multipart_chunksize=MULTIPART_CHUNK,
            max_concurrency=4,
            use_threads=True,
        )

    def reconnect(self) -> None:
        """A new session and client: credentials are read again (environment, credentials file)."""
        import boto3

        self._session = boto3.session.Session()
        self.client = self._session.client("s3", endpoint_url=self._endpoint, config=self._config)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def refusal(self, exc: BaseException) -> str | None:
        """S3's own error codes, looked for through the exception's causes (boto3's transfer
        manager wraps the ClientError of a multipart upload in an S3UploadFailedError)."""
        from botocore.exceptions import (
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        seen = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
                return self._redact(f"{self.url}: {exc}")
            if isinstance(exc, ClientError):
                error = exc.response.get("Error", {})
                code = str(error.get("Code", ""))
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code in _S3_REFUSALS or code.startswith("KMS.") or status in _S3_REFUSAL_STATUS:
                    operation = f" on {exc.operation_name}" if exc.operation_name else ""
                    hint = f"; {_S3_HINTS[code]}" if code in _S3_HINTS else ""
                    return self._redact(f"{self.url}: {code} ({error.get('Message', '')}){operation}{hint}")
                return None
            exc = exc.__cause__ or exc.__context__
        return None

    def _redact(self, text: str) -> str:
        """S3 does not quote secrets in its errors; this makes sure no message carries one."""
        from botocore.credentials import Credentials

        secrets = [os.environ.get(name, "") for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")]
        credentials = self._session.get_credentials()
        if type(credentials) is Credentials:  # refreshable credentials would be fetched again to read
            secrets += [credentials.secret_key or "", credentials.token or ""]
        for secret in secrets:
            if len(secret) >= 8:
                text = text.replace(secret, "***")
        return _one_line(text)

    def move_verified(self, local: Path, key: str, *, size: int, checked: os.stat_result) -> bool:
        return False  # an object store is never the spool's file system: put_verified copies

    def put_verified(self, local: Path, key: str, *, size: int, digest: str) -> None:
        full_key = self._key(key)
        metadata = {DIGEST_METADATA: digest}
        # The client sends a CRC32 of the body (cheap next to sha256) and the server refuses a
        # body that does not match it: the object is the local file, which the uploader checked.
        if size < MULTIPART_THRESHOLD:
            with open(local, "rb") as body:
                self.client.put_object(
                    Bucket=self.bucket,
                    Key=full_key,
                    Body=body,
                    Metadata=metadata,
                    ChecksumAlgorithm="CRC32",
                )
        else:
            self.client.upload_file(
                str(local),
                self.bucket,
                full_key,
                ExtraArgs={"Metadata": metadata, "ChecksumAlgorithm": "CRC32"},
                Config=self.transfer,
            )
        if not self.has_verified(key, size=size, digest=digest):
            raise VerificationError(f"s3://{self.bucket}/{full_key}: stored object does not match the local file")

    def has_verified(self, key: str, *, size: int, digest: str) -> bool:
        head = self._head(key)
        return (
            head is not None
            and head["ContentLength"] == size
            and head.get("Metadata", {}).get(DIGEST_METADATA) == digest
        )

    def put_bytes_verified(self, data: bytes, key: str) -> None:
        sha256 = hashlib.sha256(data).hexdigest()
        self.client.put_object(
            Bucket=self.bucket,
            Key=self._key(key),
            Body=data,
            Metadata={SHA256_METADATA: sha256},
            ChecksumAlgorithm="CRC32",
        )
        if not self.has_sha256(key, size=len(data), sha256=sha256):
            raise VerificationError(f"s3://{self.bucket}/{self._key(key)}: stored object does not match the bytes sent")

    def put_file_verified(self, local: Path, key: str, *, size: int, sha256: str) -> None:
        if size < MULTIPART_THRESHOLD:
            # Send exactly the bytes hashed here: a file that changed since the caller hashed it is
            # refused instead of stored under a sha256 it does not have.
            data = local.read_bytes()
            if (len(data), hashlib.sha256(data).hexdigest()) != (size, sha256):
                raise VerificationError(
                    f"{local}: changed since it was hashed ({len(data)} bytes now, {size} expected)"
                )
            self.put_bytes_verified(data, key)
            return
        # Multipart parts are read by the transfer's threads; a file that changes meanwhile is the
        # caller's to notice (hsx sync compares size and mtime before hashing and after the upload).
        self.client.upload_file(
            str(local),
            self.bucket,
            self._key(key),
            ExtraArgs={"Metadata": {SHA256_METADATA: sha256}, "ChecksumAlgorithm": "CRC32"},
            Config=self.transfer,
        )
        if not self.has_sha256(key, size=size, sha256=sha256):
            raise VerificationError(f"s3://{self.bucket}/{self._key(key)}: stored object does not match {local}")

    def has_sha256(self, key: str, *, size: int, sha256: str) -> bool:
        head = self._head(key)
        return (
            head is not None
            and head["ContentLength"] == size
            and head.get("Metadata", {}).get(SHA256_METADATA) == sha256
        )

    def _head(self, key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("404", "NoSuchKey", "NotFound"):
                return None
            if code in ("401", "403"):
                self._name_head_refusal(key)
            raise

    def _name_head_refusal(self, key: str) -> None:
        """A refused HEAD has no body, so no error code: a one-byte GET of the same key gets the
        code (SignatureDoesNotMatch, InvalidAccessKeyId, ExpiredToken, AccessDenied, ...) and
        raises it; the refusal then names the cause instead of a bare 403."""
        from botocore.exceptions import ClientError

        try:
            self.client.get_object(Bucket=self.bucket, Key=self._key(key), Range="bytes=0-0")["Body"].close()
        except ClientError as named:
            if named.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound", "403", "401"):
                raise

    def read_bytes(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def open_read(self, key: str) -> BinaryIO:
        """The object as a stream (one GET), for one read front to back in bounded memory."""
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]

    def read_prefix(self, key: str, length: int) -> tuple[bytes, int]:
        """The first `length` bytes (fewer if the object is shorter) and the object's size, in one
        ranged GET: its Content-Range ends with the whole size."""
        response = self.client.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes=0-{length - 1}")
        data = response["Body"].read()
        content_range = response.get("ContentRange")  # "bytes 0-65535/1234567"; absent if S3 sent it all
        return data, int(content_range.rsplit("/", 1)[1]) if content_range else len(data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def keys(self) -> Iterator[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        prefix = f"{self.prefix}/" if self.prefix else ""
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                yield obj["Key"][len(prefix) :]


def open_destination(location: Location, *, max_connections: int = 100) -> Destination:
    if location.is_s3:
        return S3Destination(location.bucket, location.path, max_connections=max_connections)
    return FileDestination(Path(location.path))


PROBE_BYTES = b"hsx destination probe: written, read back and deleted before a job is published\n"


def probe(dest: Destination, key: str) -> None:
    """Write a small object at `key`, read it back and delete it: the three things a job needs of
    its destination (the uploaders put and verify, the producer's bundle is read back by resumes).
    Raises what the destination raised; `dest.refusal(exc)` words it."""
    dest.put_bytes_verified(PROBE_BYTES, key)
    if dest.read_bytes(key) != PROBE_BYTES:
        raise VerificationError(f"{key}: reading the probe object back gave other bytes than were written")
    dest.delete(key)


def open_job_folder(dest: Location, job: str, *, max_connections: int = 16) -> Destination:
    """The destination rooted at `<dest>/<job>`: listing it lists only this job's objects (an S3
    prefix shared by many jobs is not walked whole). Its keys are `sample_key(job, i)` without the
    leading `<job>/` (see `relative_sample_key`)."""
    return open_destination(dest.child(job), max_connections=max_connections)
