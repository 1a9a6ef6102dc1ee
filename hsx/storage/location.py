"""Where a destination is: `Location`, a folder of one store (a local directory, an S3 bucket's key
prefix, ...), parsed and checked once (`Location.parse`) from what a user wrote (`--dest`, a job
folder URL, a path) through the destination registry (hsx/storage/destinations/), which knows
each URL scheme. `str()` gives the canonical URL that job specs, logs and errors carry;
`open_destination` opens a Location without parsing it again.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import msgspec

from hsx.errors import HsxError
from hsx.storage.destinations import SCHEMES, Destination, Scheme, by_scheme, forms

# What a user meant as a URL: a scheme and its colon ("s3:/b", "S3://b", "s4://b"), or one of
# ours with the colon left out ("file//out"). A local folder whose name holds a colon is `./a:b`.
_SCHEME_COLON = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_SCHEME_NO_COLON = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)//")


# A msgspec Struct, not a dataclass: a config that holds one crosses `hsx up`'s pipe to a child
# (commands/child.py) as JSON and comes back a Location.
class Location(msgspec.Struct, frozen=True, kw_only=True):
    scheme: str = "file"  # a key of the destination registry
    bucket: str = ""  # the URL's host part: an S3 bucket, an Azure container; "" for a local directory
    path: str  # an object store's key prefix, no slash at either end ("" for its root); local: absolute

    @classmethod
    def parse(cls, text: str | Path, *, what: str = "--dest") -> Location:
        """`text` as a Location, or a one-line HsxError naming `what` (the flag or argument). A
        `Path` is a path; text that looks like a URL is one of the registry's or refused."""
        if isinstance(text, Path):
            return cls(path=str(text.expanduser().resolve()))
        url = str(text)
        try:
            split = urlsplit(url)
        except ValueError as exc:  # "s3://[b": a bracket that opens no IPv6 host
            raise HsxError(f"{what} {url!r}: not a URL hsx reads ({exc}); use {forms()}") from None
        if url.startswith(tuple(f"{name}://" for name in SCHEMES)):
            bucket, path = SCHEMES[split.scheme].parse(url, split, what=what)
            return cls(scheme=split.scheme, bucket=bucket, path=path)
        _refuse_url_like(url, what)
        if not url.strip():
            raise HsxError(f"{what} is empty: give {forms()}")
        return cls(path=str(Path(url).expanduser().resolve()))

    @property
    def url(self) -> str:
        return self._scheme().url(self.bucket, self.path)

    def __str__(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        """The last component of the path: a job folder's job name ("" at a bucket's or disk's root)."""
        return PurePosixPath(self.path).name

    def child(self, name: str) -> Location:
        """`<self>/<name>`: e.g. a job's folder under its destination."""
        return Location(scheme=self.scheme, bucket=self.bucket, path=self._scheme().child(self.path, name))

    @property
    def local_folder(self) -> Path | None:
        """The folder on this machine that holds the files (file://): its file system has a free
        space to ask. None for a remote store (S3, ...), which has none."""
        return self._scheme().local_folder(self.path)

    def _scheme(self) -> Scheme:
        return by_scheme(self.scheme)

    @classmethod
    def parse_job_folder(cls, text: str | Path, *, what: str) -> Location:
        """A job's folder (`s3://bucket/prefix/JOB`, `file:///out/JOB`, a path): its `name` is the job."""
        folder = cls.parse(text, what=what)
        if not folder.name:
            raise HsxError(
                f"{what} {str(text)!r}: not a job folder (expected e.g. s3://bucket/prefix/JOB or file:///out/JOB)"
            )
        return folder


def open_destination(location: Location, *, max_connections: int = 100) -> Destination:
    """The destination at `location`, with a client for up to `max_connections` requests at once."""
    return location._scheme().open(location.bucket, location.path, max_connections=max_connections)


def open_job_folder(dest: Location, job: str, *, max_connections: int = 16) -> Destination:
    """The destination rooted at `<dest>/<job>`: listing it lists only this job's objects (a
    prefix shared by many jobs is not walked whole). Its keys are `sample_key(job, i)` without
    the leading `<job>/` (see `relative_sample_key`)."""
    return open_destination(dest.child(job), max_connections=max_connections)


def _refuse_url_like(url: str, what: str) -> None:
    """A one-line HsxError for text that looks like a URL but is none of the registry's (called
    after those): a typo is refused, never taken as a local folder named after it."""
    match = _SCHEME_COLON.match(url) or _SCHEME_NO_COLON.match(url)
    if not match:
        return
    written = match.group(1)
    near = difflib.get_close_matches(written.lower(), list(SCHEMES), n=1, cutoff=0.5)
    well_formed = url[match.end() :].startswith("//") and match.group(0).endswith(":")
    if not near and not match.group(0).endswith(":"):
        return  # "data//out": a path with a doubled slash, no scheme meant
    rest = url[len(written) :].lstrip(":/")
    if near and rest:
        advice = f"did you mean {SCHEMES[near[0]].suggestion(rest)}? use {forms()}"
    elif near or well_formed:
        advice = f"use {forms()}"
    else:
        advice = f"use {forms()} (./{url} for a local folder so named)"
    problem = f"unsupported scheme {written}://" if well_formed else "not a URL hsx reads"
    raise HsxError(f"{what} {url!r}: {problem}; {advice}")


def job_folder_argument(what: str) -> Callable[[str], Location]:
    """The parser of an argument that names a job's folder (export's SOURCE, index rebuild's JOB_URL)."""

    def parse(text: str) -> Location:
        return Location.parse_job_folder(text, what=what)

    parse.__name__ = "job folder"
    return parse


def spec_location(dest: str) -> Location:
    """A job spec's `dest`: the canonical URL the producer wrote from a Location (`str()`), as one
    again. The spec travels as JSON, so its destination is text until here."""
    return Location.parse(dest, what="the job spec's dest")
