"""The destinations, one module each, and the registry that `--dest`, a job spec's `dest` and every
reader's URL are parsed through (hsx/storage/location.py), keyed by URL scheme. Adding a store is
its module (a `Scheme` and its `Destination`, hsx/storage/destinations/base.py) and one entry in
SCHEMES below. Also here: `probe`, the producer's write test of any destination, and
`store_errors`, what any of them raises when its store fails.
"""

from hsx.errors import HsxError
from hsx.storage.destinations.azure import AZURE
from hsx.storage.destinations.base import (
    Destination,
    Scheme,
    VerificationError,
    file_sha256,
)
from hsx.storage.destinations.file import FILE
from hsx.storage.destinations.s3 import S3

__all__ = [
    "PROBE_BYTES",
    "SCHEMES",
    "Destination",
    "Scheme",
    "VerificationError",
    "by_scheme",
    "error_line",
    "file_sha256",
    "forms",
    "probe",
    "store_errors",
]

# In the order --dest's help and errors list them.
SCHEMES: dict[str, Scheme] = {
    one.name: one
    for one in (
        S3,
        FILE,
        AZURE,
    )
}


def by_scheme(name: str) -> Scheme:
    """The scheme of that name; HsxError for one no destination has (a Location holds only
    registered schemes: this is a bug's, or a hand-made Location's, error)."""
    found = SCHEMES.get(name)
    if found is None:
        raise HsxError(f"no destination has the URL scheme {name!r} (there are {', '.join(SCHEMES)})")
    return found


def forms() -> str:
    """What --dest takes, in words: "s3://bucket/prefix, file:///dir, ... or a path"."""
    return f"{', '.join(one.form for one in SCHEMES.values())} or a path"


def store_errors() -> tuple[type[BaseException], ...]:
    """What a destination's calls raise when its store fails, after its client's own retries:
    OSError, VerificationError and each installed client's own errors. Used as `except
    store_errors() as exc:`, so that the clients are imported only when something failed."""
    found: tuple[type[BaseException], ...] = (OSError, VerificationError)
    for one in SCHEMES.values():
        found += one.client_errors()
    return found


def error_line(exc: BaseException) -> str:
    """`Type: message` of a store's error, on one line (some clients' messages span several)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


PROBE_BYTES = b"hsx destination probe: written, read back and deleted before a job is published\n"


def probe(dest: Destination, key: str) -> None:
    """Write a small object at `key`, read it back and delete it: the three things a job needs of
    its destination (the uploaders put and verify, the producer's bundle is read back by resumes).
    Raises what the destination raised; `dest.refusal(exc)` words it."""
    dest.put_bytes_verified(PROBE_BYTES, key)
    if dest.read_bytes(key) != PROBE_BYTES:
        raise VerificationError(f"{key}: reading the probe object back gave other bytes than were written")
    dest.delete(key)
