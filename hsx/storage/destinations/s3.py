"""`s3://bucket/prefix`: Amazon S3 or an S3-compatible store (MinIO, Ceph, moto), through boto3.
Settings come from the standard AWS variables and files (`AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`, `AWS_PROFILE`); a custom
endpoint gets path-style addressing. Puts send a CRC32 the server checks, files of 64 MiB or more
go in parts, and a put is verified by a HEAD: the size and hsx's user metadata (the sample file's
digest, or the sha256 of other bytes). boto3 and botocore are imported here only, and only when a
destination is opened or its errors are looked at.

Design notes: docs/architecture/storage.md.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from hsx.logs import quiet_library
from hsx.storage.destinations.base import Destination, ObjectStore, VerificationError, redacted

MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 64 << 20
DIGEST_METADATA = "hsx-digest"  # S3 user metadata: the sample file's digest, compared by has_verified
SHA256_METADATA = "hsx-sha256"  # S3 user metadata: sha256 of any other file's bytes, compared by has_sha256
_MISSING = ("404", "NoSuchKey", "NotFound")

# Error codes no retry fixes: the bucket, the credentials, the clock or the permissions must
# change first.
_REFUSALS = {
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
_REFUSAL_STATUS = {401, 403}  # a response without a body to name its error (HEAD) says only this
_HINTS = {
    "AccessDenied": "the uploader needs s3:PutObject, s3:GetObject and s3:ListBucket on the prefix",
    "403": "a HEAD refusal carries no reason: wrong key or secret, an expired token, or a missing permission",
}

# botocore narrates every request at debug level, and its credentials lookup at info on every command.
quiet_library("botocore", "boto3", "s3transfer")
quiet_library("botocore.credentials", warnings_only=True)


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
                if code in _REFUSALS or code.startswith("KMS.") or status in _REFUSAL_STATUS:
                    operation = f" on {exc.operation_name}" if exc.operation_name else ""
                    hint = f"; {_HINTS[code]}" if code in _HINTS else ""
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
        return redacted(text, secrets)

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
            if code in _MISSING:
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
            if named.response.get("Error", {}).get("Code") not in (*_MISSING, "403", "401"):
                raise

    def _get(self, key: str, **ranged) -> dict:
        """A GET of `key`; FileNotFoundError when it holds nothing (as a file:// read would)."""
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key), **ranged)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _MISSING:
                raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{key}") from exc
            raise

    def read_bytes(self, key: str) -> bytes:
        return self._get(key)["Body"].read()

    def open_read(self, key: str) -> BinaryIO:
        """The object as a stream (one GET), for one read front to back in bounded memory."""
        return self._get(key)["Body"]

    def read_prefix(self, key: str, length: int) -> tuple[bytes, int]:
        """The first `length` bytes (fewer if the object is shorter) and the object's size, in one
        ranged GET: its Content-Range ends with the whole size."""
        response = self._get(key, Range=f"bytes=0-{length - 1}")
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


@dataclass(frozen=True, kw_only=True)
class S3Scheme(ObjectStore):
    def open(self, bucket: str, path: str, *, max_connections: int) -> Destination:
        return S3Destination(bucket, path, max_connections=max_connections)

    def client_errors(self) -> tuple[type[BaseException], ...]:
        from botocore.exceptions import BotoCoreError, ClientError

        return (BotoCoreError, ClientError)


S3 = S3Scheme(
    name="s3",
    form="s3://bucket/prefix",
    called="an S3 destination",
    environment={
        "AWS_ENDPOINT_URL_S3": "url",
        "AWS_ENDPOINT_URL": "url",
        "AWS_DEFAULT_REGION": "text",
        "AWS_ACCESS_KEY_ID": "text",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_SESSION_TOKEN": "secret",
        "AWS_PROFILE": "text",
    },
)
