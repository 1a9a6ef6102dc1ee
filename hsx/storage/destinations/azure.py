"""`az://container/prefix`: Azure Blob Storage (or its emulator, Azurite), through the
`azure-storage-blob` client: `pip install 'hsx-extract[azure]'`.

Credentials come from the Azure SDK's standard environment: `AZURE_STORAGE_CONNECTION_STRING`
(an account key or a SAS, and the endpoint), else `AZURE_STORAGE_ACCOUNT_URL`
(`https://ACCOUNT.blob.core.windows.net`, a SAS in its query or, without one, azure-identity's
DefaultAzureCredential: `AZURE_CLIENT_ID`/`AZURE_TENANT_ID`/`AZURE_CLIENT_SECRET`, a managed or
workload identity, `az login`). Puts send an MD5 of each request's body that the service checks
(`validate_content`); a file of more than SINGLE_PUT_MAX bytes goes as blocks of BLOCK_SIZE, four
at a time. A put is verified as an S3 one is: the blob's size and hsx's metadata read back
(`hsx_digest`, the sample file's digest; `hsx_sha256`, the sha256 of other bytes; Azure's
metadata names are identifiers, hence the underscore). The client is imported here only, and
only when a destination is opened or its errors are looked at.

Design notes: docs/architecture/storage.md.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

from hsx.errors import HsxError
from hsx.logs import quiet_library
from hsx.storage.destinations.base import Destination, ObjectStore, VerificationError, redacted

SINGLE_PUT_MAX = 8 << 20  # larger files go in blocks: a single put holds its body in memory
BLOCK_SIZE = 8 << 20
DIGEST_METADATA = "hsx_digest"
SHA256_METADATA = "hsx_sha256"
CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_URL = "AZURE_STORAGE_ACCOUNT_URL"
_EXTRA = "pip install 'hsx-extract[azure]'"

# Error codes no retry fixes: the container, the credentials or the permissions must change first.
_REFUSALS = {
    "ContainerNotFound",
    "ContainerDisabled",
    "AuthenticationFailed",
    "AuthorizationFailure",
    "AuthorizationPermissionMismatch",
    "AuthorizationProtocolMismatch",
    "AuthorizationResourceTypeMismatch",
    "AuthorizationServiceMismatch",
    "AuthorizationSourceIPMismatch",
    "InsufficientAccountPermissions",
    "InvalidAuthenticationInfo",
    "AccountIsDisabled",
    "InvalidResourceName",
    "KeyBasedAuthenticationNotPermitted",
}
_REFUSAL_STATUS = {401, 403}
_HINTS = {
    "AuthorizationPermissionMismatch": "the identity needs the Storage Blob Data Contributor role on the container",
    "AuthorizationFailure": "wrong account key, an expired SAS, or a network rule of the account",
}

# The SDK logs every request and response at info (headers, redacted), and identity's lookups.
quiet_library("azure")
quiet_library("azure.core.pipeline.policies.http_logging_policy", "azure.identity", warnings_only=True)


def _code(exc: BaseException) -> str:
    """The service's error code of an Azure error ("" when it has none)."""
    code = getattr(exc, "error_code", None) or ""
    return str(getattr(code, "value", code))


def _secrets() -> list[str]:
    """The secret parts of the variables the client reads: account keys, SAS signatures, a client secret."""
    found = [os.environ.get("AZURE_CLIENT_SECRET", "")]
    for part in os.environ.get(CONNECTION_STRING, "").split(";"):
        name, _, value = part.partition("=")
        if name.strip() in ("AccountKey", "SharedAccessSignature"):
            found.append(value)
    for text in (os.environ.get(CONNECTION_STRING, ""), os.environ.get(ACCOUNT_URL, "")):
        found += [query.partition("=")[2] for query in text.replace("?", "&").split("&") if query.startswith("sig=")]
    return found


class _BlobStream(io.RawIOBase):
    """A blob's download as a file object: read in the client's chunks, in bounded memory."""

    def __init__(self, download) -> None:
        self._download = download

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._download.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class AzureDestination:
    latency_bound = True

    def __init__(self, container: str, prefix: str, *, max_connections: int = 100) -> None:
        self.container = container
        self.prefix = prefix.strip("/")
        self.url = f"az://{container}/{self.prefix}" if self.prefix else f"az://{container}"
        self._connections = max_connections + 4
        self.reconnect()

    def reconnect(self) -> None:
        """A new client: the environment's credentials are read again."""
        import requests
        from azure.core.pipeline.transport import RequestsTransport
        from azure.storage.blob import BlobServiceClient
        from urllib3.util.retry import Retry

        # One pooled connection per upload in flight (the SDK's own pool holds 10); its retry
        # policy retries, not urllib3.
        session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(
            pool_connections=4,
            pool_maxsize=self._connections,
            max_retries=Retry(total=False, redirect=False, raise_on_status=False),
        )
        for prefix in ("http://", "https://"):
            session.mount(prefix, adapter)
        options = {
            "transport": RequestsTransport(session=session),
            "max_single_put_size": SINGLE_PUT_MAX,
            "max_block_size": BLOCK_SIZE,
            "connection_timeout": 10,
            "read_timeout": 120,
        }
        connection_string = os.environ.get(CONNECTION_STRING)
        account_url = os.environ.get(ACCOUNT_URL)
        if connection_string:
            try:
                service = BlobServiceClient.from_connection_string(connection_string, **options)
            except ValueError as exc:
                raise HsxError(f"{self.url}: {CONNECTION_STRING} is not a connection string ({exc})") from None
        elif account_url:
            service = BlobServiceClient(account_url, credential=_url_credential(account_url), **options)
        else:
            raise HsxError(
                f"{self.url}: no Azure credentials: set {CONNECTION_STRING}, or {ACCOUNT_URL} "
                "(with a SAS in its query, or an identity DefaultAzureCredential finds)"
            )
        self._container = service.get_container_client(self.container)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _blob(self, key: str):
        return self._container.get_blob_client(self._key(key))

    def refusal(self, exc: BaseException) -> str | None:
        """The service's own error codes (or a 401/403 without one), looked for through the
        exception's causes; a credential that cannot get a token is one too."""
        from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

        seen = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            if isinstance(exc, HttpResponseError):
                code, status = _code(exc), exc.status_code
                if code in _REFUSALS or status in _REFUSAL_STATUS or isinstance(exc, ClientAuthenticationError):
                    message = str(exc.message or exc).split("\n")[0]
                    hint = f"; {_HINTS[code]}" if code in _HINTS else ""
                    return redacted(f"{self.url}: {code or status} ({message}){hint}", _secrets())
                return None
            exc = exc.__cause__ or exc.__context__
        return None

    def move_verified(self, local: Path, key: str, *, size: int, checked: os.stat_result) -> bool:
        return False  # an object store is never the spool's file system: put_verified copies

    def _upload(self, body, key: str, *, size: int, metadata: dict[str, str]) -> None:
        self._blob(key).upload_blob(
            body, length=size, overwrite=True, metadata=metadata, validate_content=True, max_concurrency=4
        )

    def put_verified(self, local: Path, key: str, *, size: int, digest: str) -> None:
        with open(local, "rb") as body:
            self._upload(body, key, size=size, metadata={DIGEST_METADATA: digest})
        if not self.has_verified(key, size=size, digest=digest):
            raise VerificationError(f"{self.url}/{key}: stored blob does not match the local file")

    def has_verified(self, key: str, *, size: int, digest: str) -> bool:
        properties = self._properties(key)
        return properties is not None and properties.size == size and properties.metadata.get(DIGEST_METADATA) == digest

    def put_bytes_verified(self, data: bytes, key: str) -> None:
        sha256 = hashlib.sha256(data).hexdigest()
        self._upload(data, key, size=len(data), metadata={SHA256_METADATA: sha256})
        if not self.has_sha256(key, size=len(data), sha256=sha256):
            raise VerificationError(f"{self.url}/{key}: stored blob does not match the bytes sent")

    def put_file_verified(self, local: Path, key: str, *, size: int, sha256: str) -> None:
        if size <= SINGLE_PUT_MAX:
            # Send exactly the bytes hashed here: a file that changed since the caller hashed it is
            # refused instead of stored under a sha256 it does not have.
            data = local.read_bytes()
            if (len(data), hashlib.sha256(data).hexdigest()) != (size, sha256):
                raise VerificationError(
                    f"{local}: changed since it was hashed ({len(data)} bytes now, {size} expected)"
                )
            self.put_bytes_verified(data, key)
            return
        # Blocks are read by the client's threads; a file that changes meanwhile is the caller's to
        # notice (hsx sync compares size and mtime before hashing and after the upload).
        with open(local, "rb") as body:
            self._upload(body, key, size=size, metadata={SHA256_METADATA: sha256})
        if not self.has_sha256(key, size=size, sha256=sha256):
            raise VerificationError(f"{self.url}/{key}: stored blob does not match {local}")

    def has_sha256(self, key: str, *, size: int, sha256: str) -> bool:
        properties = self._properties(key)
        return properties is not None and properties.size == size and properties.metadata.get(SHA256_METADATA) == sha256

    def _properties(self, key: str):
        """The blob's properties; None when the key holds nothing (a missing container raises)."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            return self._blob(key).get_blob_properties()
        except ResourceNotFoundError as exc:
            if _code(exc) == "BlobNotFound":
                return None
            raise

    def _download(self, key: str, **ranged):
        """A download of `key`; FileNotFoundError when it holds nothing (as a file:// read would)."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            return self._blob(key).download_blob(**ranged)
        except ResourceNotFoundError as exc:
            if _code(exc) == "BlobNotFound":
                raise FileNotFoundError(errno.ENOENT, "no such blob", f"{self.url}/{key}") from exc
            raise

    def read_bytes(self, key: str) -> bytes:
        return self._download(key).readall()

    def open_read(self, key: str) -> BinaryIO:
        return io.BufferedReader(_BlobStream(self._download(key)), buffer_size=1 << 20)

    def read_prefix(self, key: str, length: int) -> tuple[bytes, int]:
        """The first `length` bytes in one ranged GET, whose Content-Range ends with the blob's size."""
        from azure.core.exceptions import HttpResponseError

        try:
            download = self._download(key, offset=0, length=length)
        except HttpResponseError as exc:
            if exc.status_code == 416:  # a range of an empty blob
                return b"", 0
            raise
        data = download.readall()
        content_range = download.properties.content_range  # "bytes 0-65535/1234567"
        return data, int(content_range.rsplit("/", 1)[1]) if content_range else len(data)

    def delete(self, key: str) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            self._blob(key).delete_blob()
        except ResourceNotFoundError as exc:
            if _code(exc) != "BlobNotFound":
                raise

    def keys(self) -> Iterator[str]:
        prefix = f"{self.prefix}/" if self.prefix else ""
        for name in self._container.list_blob_names(name_starts_with=prefix):
            yield name[len(prefix) :]


def _url_credential(account_url: str):
    """None for a URL that carries a SAS (the client signs nothing); else DefaultAzureCredential."""
    if "sig=" in urlsplit(account_url).query:
        return None
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise HsxError(
            f"{ACCOUNT_URL} without a SAS needs azure-identity ({_EXTRA}), or set {CONNECTION_STRING}"
        ) from None
    return DefaultAzureCredential()


@dataclass(frozen=True, kw_only=True)
class AzureScheme(ObjectStore):
    def open(self, bucket: str, path: str, *, max_connections: int) -> Destination:
        try:
            import azure.storage.blob  # noqa: F401
        except ImportError:
            raise HsxError(f"{self.url(bucket, path)}: Azure Blob Storage needs its client: {_EXTRA}") from None
        return AzureDestination(bucket, path, max_connections=max_connections)

    def client_errors(self) -> tuple[type[BaseException], ...]:
        try:
            from azure.core.exceptions import AzureError
        except ImportError:
            return ()
        return (AzureError,)


AZURE = AzureScheme(
    name="az",
    form="az://container/prefix",
    called="an Azure Blob destination",
    bucket_word="container",
    # Azure's rule: 3-63 lowercase letters, digits and single hyphens, starting and ending with a
    # letter or digit.
    bucket_form=r"(?=.{3,63}$)[a-z0-9]+(-[a-z0-9]+)*",
    bucket_rule="3 to 63 lowercase letters, digits and single hyphens, starting and ending with a letter or digit",
    environment={
        CONNECTION_STRING: "secret",
        ACCOUNT_URL: "secret",
        "AZURE_CLIENT_ID": "text",
        "AZURE_TENANT_ID": "text",
        "AZURE_CLIENT_SECRET": "secret",
    },
)
