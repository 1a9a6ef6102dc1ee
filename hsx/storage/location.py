"""Where a destination is: `Location`, an S3 bucket and key prefix or a local directory, parsed and
checked once (`Location.parse`) from what a user wrote (`--dest`, a job folder URL, a path).
`str()` gives the canonical URL that job specs, logs and errors carry; `open_destination`
(hsx/storage/destinations.py) opens a Location without parsing it again."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

import msgspec

from hsx.errors import HsxError

_FORMS = "s3://bucket/prefix, file:///dir or a path"
_SCHEMES = ("s3", "file")
# What a user meant as a URL: a scheme and its colon ("s3:/b", "S3://b", "s4://b"), or one of
# ours with the colon left out ("file//out"). A local folder whose name holds a colon is `./a:b`.
_SCHEME_COLON = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_SCHEME_NO_COLON = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)//")


# A msgspec Struct, not a dataclass: a config that holds one crosses `hsx up`'s pipe to a child
# (commands/child.py) as JSON and comes back a Location.
class Location(msgspec.Struct, frozen=True, kw_only=True):
    bucket: str = ""  # the S3 bucket; "" for a local directory
    path: str  # S3: the key prefix, no slash at either end ("" for the bucket's root); local: absolute

    @classmethod
    def parse(cls, text: str | Path, *, what: str = "--dest") -> Location:
        """`text` as a Location, or a one-line HsxError naming `what` (the flag or argument). A
        `Path` is a path; text that looks like a URL is one of ours (`s3://`, `file://`) or refused."""
        if isinstance(text, Path):
            return cls(path=str(text.expanduser().resolve()))
        url = str(text)
        split = urlsplit(url)
        if url.startswith("s3://"):
            if not split.netloc:
                raise HsxError(f"{what} {url!r}: an S3 destination needs a bucket, e.g. s3://bucket/prefix")
            return cls(bucket=split.netloc, path=split.path.strip("/"))
        if url.startswith("file://"):
            if split.netloc not in ("", "localhost"):
                raise HsxError(f"{what} {url!r}: file:// URLs must be local (file:///absolute/dir)")
            if not split.path.startswith("/"):
                raise HsxError(f"{what} {url!r}: a file:// URL needs an absolute path (file:///absolute/dir)")
            return cls(path=str(Path(unquote(split.path))))
        _refuse_url_like(url, what)
        if not url.strip():
            raise HsxError(f"{what} is empty: give {_FORMS}")
        return cls(path=str(Path(url).expanduser().resolve()))

    @property
    def is_s3(self) -> bool:
        return bool(self.bucket)

    @property
    def url(self) -> str:
        if self.is_s3:
            return f"s3://{self.bucket}/{self.path}" if self.path else f"s3://{self.bucket}"
        return Path(self.path).as_uri()

    def __str__(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        """The last component of the path: a job folder's job name ("" at a bucket's or disk's root)."""
        return PurePosixPath(self.path).name

    def child(self, name: str) -> Location:
        """`<self>/<name>`: e.g. a job's folder under its destination."""
        if self.is_s3:
            return Location(bucket=self.bucket, path=f"{self.path}/{name}" if self.path else name)
        return Location(path=str(Path(self.path, name)))

    @classmethod
    def parse_job_folder(cls, text: str | Path, *, what: str) -> Location:
        """A job's folder (`s3://bucket/prefix/JOB`, `file:///out/JOB`, a path): its `name` is the job."""
        folder = cls.parse(text, what=what)
        if not folder.name:
            raise HsxError(
                f"{what} {str(text)!r}: not a job folder (expected e.g. s3://bucket/prefix/JOB or file:///out/JOB)"
            )
        return folder


def _refuse_url_like(url: str, what: str) -> None:
    """A one-line HsxError for text that looks like a URL but is not `s3://` or `file://` (called
    after those two): a typo is refused, never taken as a local folder named after it."""
    match = _SCHEME_COLON.match(url) or _SCHEME_NO_COLON.match(url)
    if not match:
        return
    scheme = match.group(1)
    near = difflib.get_close_matches(scheme.lower(), _SCHEMES, n=1, cutoff=0.5)
    well_formed = url[match.end() :].startswith("//") and match.group(0).endswith(":")
    if not near and not match.group(0).endswith(":"):
        return  # "data//out": a path with a doubled slash, no scheme meant
    rest = url[len(scheme) :].lstrip(":/")
    if near and rest:
        advice = f"did you mean {near[0]}://{'/' if near[0] == 'file' else ''}{rest}? use {_FORMS}"
    elif near or well_formed:
        advice = f"use {_FORMS}"
    else:
        advice = f"use {_FORMS} (./{url} for a local folder so named)"
    problem = f"unsupported scheme {scheme}://" if well_formed else "not a URL hsx reads"
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
