"""A destination named once (hsx/storage/location.py): what each form a user writes becomes, the
one-line errors, and that a Location survives the trips it makes (the canonical URL in a job
spec, JSON through `hsx up`'s pipe to a child) unchanged."""

import re

import msgspec
import pytest

from hsx.errors import HsxError
from hsx.model.layers import Preset, parse_layers
from hsx.storage.destinations import SCHEMES, forms
from hsx.storage.destinations.file import FileDestination
from hsx.storage.destinations.s3 import S3Destination
from hsx.storage.location import Location, open_destination, open_job_folder, spec_location
from hsx.wire.jobs import _dest_form


@pytest.mark.parametrize(
    ("text", "bucket", "path", "url"),
    [
        ("s3://bucket/some/prefix/", "bucket", "some/prefix", "s3://bucket/some/prefix"),
        ("s3://bucket", "bucket", "", "s3://bucket"),
        ("file:///out/dir/", "", "/out/dir", "file:///out/dir"),
        ("file://localhost/a%20b", "", "/a b", "file:///a%20b"),
    ],
)
def test_each_form_is_parsed_once_into_its_parts(text, bucket, path, url):
    location = Location.parse(text)
    assert (location.bucket, location.path, str(location)) == (bucket, path, url)
    assert Location.parse(str(location)) == location  # the canonical URL parses to itself


@pytest.mark.parametrize("name", list(SCHEMES))
def test_each_registered_scheme_parses_its_own_form_and_its_job_folder_passes_the_spec_check(name):
    """The registry is the one list: what a scheme's form parses to, its canonical URL parses
    back to; a job folder under it is what a job spec may carry, and comes back from the spec."""
    location = Location.parse(SCHEMES[name].form)
    assert location.scheme == name and Location.parse(str(location)) == location
    folder = location.child("job-1")
    assert folder.name == "job-1" and _dest_form(str(folder)) and spec_location(str(folder)) == folder


def test_only_a_local_folder_has_one(tmp_path):
    assert Location.parse(tmp_path).local_folder == tmp_path
    assert Location.parse("s3://bucket/p").local_folder is None


def test_a_plain_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Location.parse("out/run1") == Location(path=str(tmp_path / "out" / "run1"))
    assert str(Location.parse("out")) == (tmp_path / "out").as_uri()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("s3://", "--dest 's3://': an S3 destination needs a bucket"),
        ("file://host/x", "--dest 'file://host/x': file:// URLs must be local"),
        ("ftp://x/y", "--dest 'ftp://x/y': unsupported scheme"),
        ("", "--dest is empty"),
        ("s3://[b/p", "--dest 's3://[b/p': not a URL hsx reads (Invalid IPv6 URL)"),
        (
            "s3:/hidden-states/runs",
            "--dest 's3:/hidden-states/runs': not a URL hsx reads; did you mean s3://hidden-states/runs?",
        ),
        ("file//data/out", "--dest 'file//data/out': not a URL hsx reads; did you mean file:///data/out?"),
        ("s4://b/p", "--dest 's4://b/p': unsupported scheme s4://; did you mean s3://b/p?"),
        ("S3://b/p", "--dest 'S3://b/p': unsupported scheme S3://; did you mean s3://b/p?"),
        ("file:/abs", "--dest 'file:/abs': not a URL hsx reads; did you mean file:///abs?"),
        (
            "run:2/out",
            f"--dest 'run:2/out': not a URL hsx reads; use {forms()} (./run:2/out for a local folder so named)",
        ),
    ],
)
def test_bad_forms_are_one_line_errors_naming_the_flag(text, error):
    with pytest.raises(HsxError, match="^" + re.escape(error)) as raised:
        Location.parse(text)
    assert "\n" not in str(raised.value)


def test_paths_that_only_look_odd_are_still_paths(tmp_path, monkeypatch):
    """A doubled slash, a colon after `./`, a Path holding a colon: local folders, as written."""
    monkeypatch.chdir(tmp_path)
    assert Location.parse("data//out") == Location(path=str(tmp_path / "data" / "out"))
    assert Location.parse("./run:2") == Location(path=str(tmp_path / "run:2"))
    assert Location.parse(tmp_path / "a:b") == Location(path=str(tmp_path / "a:b"))


def test_a_job_folder_names_its_job_and_a_root_is_not_one(tmp_path):
    folder = Location.parse_job_folder("s3://bucket/prefix/job-7/", what="SOURCE")
    assert folder.name == "job-7" and folder == Location.parse("s3://bucket/prefix").child("job-7")
    with pytest.raises(HsxError, match=r"^SOURCE 's3://bucket': not a job folder"):
        Location.parse_job_folder("s3://bucket", what="SOURCE")


def test_opening_a_location_parses_nothing_again(tmp_path):
    s3 = open_destination(Location.parse("s3://bucket/p/"), max_connections=1)
    assert isinstance(s3, S3Destination) and (s3.bucket, s3.prefix, s3.url) == ("bucket", "p", "s3://bucket/p")
    local = open_job_folder(Location.parse(tmp_path), "job")
    assert isinstance(local, FileDestination) and local.url == (tmp_path / "job").as_uri()
    with pytest.raises(AttributeError):
        open_destination(str(tmp_path))  # text is parsed at the edge, never here


def test_a_job_specs_dest_is_a_location_again():
    location = Location.parse("s3://bucket/hidden-states")
    assert spec_location(str(location)) == location
    with pytest.raises(HsxError, match="^the job spec's dest 'gs://b': unsupported scheme"):
        spec_location("gs://b")


def test_a_location_and_a_layer_request_cross_the_pipe_to_a_child_unchanged(tmp_path):
    """`hsx up` sends each child its config as JSON (commands/child.py): a Location, a preset and
    layer indices come back as the same typed values."""
    from hsx.commands.child import order, read_order
    from hsx.producer.config import ProducerConfig
    from hsx.wire.natsconn import NatsSettings

    for layers in (parse_layers("dflash:5"), parse_layers("1,-1,final")):
        cfg = ProducerConfig(
            job="j",
            model="m",
            dataset=tmp_path / "d.jsonl",
            layers=layers,
            dest=Location.parse("s3://bucket/x"),
            nats=NatsSettings(url="nats://127.0.0.1:4222"),
        )
        received, _ = read_order(order(cfg, log_level="info"))
        assert received == cfg
    assert parse_layers("dflash:5") == Preset("dflash:5") and str(Preset("dflash:5")) == "dflash:5"
    assert msgspec.json.encode(parse_layers("1,-1,final")) == b'[1,-1,"final"]'
