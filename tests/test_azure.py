"""`az://container/prefix` (hsx/storage/destinations/azure.py) against Microsoft's Azurite emulator,
installed from the npm registry into the venv on first use (`npm install azurite@AZURITE`) and
started on a free port: every verified put and read of the Destination protocol, the refusals
worded without secrets, the SAS and connection-string credentials, and one real job (produce,
consume, upload, monitor) read back through `hsx verify`, `hsx index rebuild`, `hsx export`,
HiddenStateDataset and JobStream, with `hsx sync` beside it.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_e2e_s3 import check_ok, start_monitor, wait_until_done, write_dataset
from test_verify import Services, run_cli

from hsx.errors import HsxError
from hsx.storage.destinations import azure, probe
from hsx.storage.location import Location, open_destination

AZURITE = "3.37.0"
ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key: public, in Microsoft's documentation; no real account has it.
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
START_TIMEOUT_S = 120  # a bound on a cold node start on a loaded machine, not a measurement
COUNT = 6
LAYERS = [1, 3]
# The first test that needs Azurite installs it (npm: a minute or two on a clean machine), inside
# its own set-up: the suite's 300 s per test would count the download.
pytestmark = pytest.mark.timeout(900)


def _azurite_binary() -> Path:
    """azurite-blob, installed into the venv once (a lock keeps pytest-xdist workers from
    installing it twice at once)."""
    folder = Path(sys.prefix) / "azurite" / AZURITE
    binary = folder / "node_modules" / ".bin" / "azurite-blob"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            npm = shutil.which("npm")
            if npm is None:
                pytest.fail("the Azure tests need node and npm (Azurite is installed with npm)")
            installed = subprocess.run(
                [npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder), f"azurite@{AZURITE}"],
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert installed.returncode == 0 and binary.exists(), installed.stderr[-3000:]
    return binary


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    """A running Azurite blob service: its connection string and account URL."""
    folder = tmp_path_factory.mktemp("azurite")
    log = folder / "azurite.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                str(_azurite_binary()),
                *("--blobHost", "127.0.0.1", "--blobPort", "0", "--location", str(folder / "data")),
                *("--silent", "--disableTelemetry", "--skipApiVersionCheck"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (found := re.search(rb"listens on http://127\.0\.0\.1:(\d+)", log.read_bytes())):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"Azurite did not start in {START_TIMEOUT_S} s\n{log.read_text()}"
            time.sleep(0.2)
        endpoint = f"http://127.0.0.1:{int(found.group(1))}/{ACCOUNT}"
        yield SimpleNamespace(
            endpoint=endpoint,
            connection_string=(
                f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={DEV_KEY};BlobEndpoint={endpoint};"
            ),
        )
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        if process.poll() is None:
            process.kill()


def new_container(connection_string: str) -> str:
    from azure.storage.blob import BlobServiceClient

    name = f"hsx-{uuid.uuid4().hex[:10]}"
    BlobServiceClient.from_connection_string(connection_string).create_container(name)
    return name


@pytest.fixture
def az_env(azurite, monkeypatch):
    """AZURE_STORAGE_CONNECTION_STRING set for this process and a fresh container; its name."""
    monkeypatch.delenv(azure.ACCOUNT_URL, raising=False)
    monkeypatch.setenv(azure.CONNECTION_STRING, azurite.connection_string)
    return new_container(azurite.connection_string)


def test_az_urls_are_parsed_through_the_registry():
    location = Location.parse("az://hidden-states/runs/")
    assert (location.scheme, location.bucket, location.path, str(location)) == (
        "az",
        "hidden-states",
        "runs",
        "az://hidden-states/runs",
    )
    assert Location.parse(str(location)) == location and location.local_folder is None
    assert str(location.child("job")) == "az://hidden-states/runs/job"
    for text, error in (
        ("az://", "--dest 'az://': an Azure Blob destination needs a container, e.g. az://container/prefix"),
        ("az://Big_Name/p", "--dest 'az://Big_Name/p': 'Big_Name' is not a container name (3 to 63 lowercase"),
        ("az:/box/p", "--dest 'az:/box/p': not a URL hsx reads; did you mean az://box/p?"),
        ("ftp://x", "--dest 'ftp://x': unsupported scheme ftp://; use s3://bucket/prefix, file:///dir, az://container"),
    ):
        with pytest.raises(HsxError, match="^" + re.escape(error)):
            Location.parse(text)


def test_every_verified_put_and_read_against_azurite(az_env, tmp_path, monkeypatch):
    """The Destination protocol as the uploader, the producer's bundle and the readers use it: a
    small put and one in blocks (block size made small), verified by size and metadata; reads
    whole, streamed and by prefix; a missing key is FileNotFoundError; deleting one is no error."""
    monkeypatch.setattr(azure, "SINGLE_PUT_MAX", 1 << 20)
    monkeypatch.setattr(azure, "BLOCK_SIZE", 1 << 20)
    dest = open_destination(Location.parse(f"az://{az_env}/prefix"), max_connections=4)
    assert dest.url == f"az://{az_env}/prefix" and dest.latency_bound
    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    small.write_bytes(b"sample bytes")
    large.write_bytes(os.urandom((3 << 20) + 5))  # four blocks
    for path, key in ((small, "job/0/0.safetensors"), (large, "job/0/1.safetensors")):
        size = path.stat().st_size
        assert not dest.has_verified(key, size=size, digest="d1")
        dest.put_verified(path, key, size=size, digest="d1")
        assert dest.has_verified(key, size=size, digest="d1")
        assert not dest.has_verified(key, size=size, digest="d2") and not dest.has_verified(key, size=1, digest="d1")
        assert dest.read_bytes(key) == path.read_bytes()
        with dest.open_read(key) as stream:
            assert b"".join(iter(lambda: stream.read(100_000), b"")) == path.read_bytes()
        assert dest.read_prefix(key, 5) == (path.read_bytes()[:5], size)
    sha256 = hashlib.sha256(large.read_bytes()).hexdigest()
    dest.put_file_verified(large, "job/_hsx/tokens.arrow", size=large.stat().st_size, sha256=sha256)
    assert dest.has_sha256("job/_hsx/tokens.arrow", size=large.stat().st_size, sha256=sha256)
    dest.put_bytes_verified(b"", "job/_hsx/empty")
    assert dest.read_prefix("job/_hsx/empty", 64) == (b"", 0)
    assert sorted(dest.keys()) == [
        "job/0/0.safetensors",
        "job/0/1.safetensors",
        "job/_hsx/empty",
        "job/_hsx/tokens.arrow",
    ]
    for read in (dest.read_bytes, dest.open_read, lambda key: dest.read_prefix(key, 8)):
        with pytest.raises(FileNotFoundError):
            read("job/nothing")
    dest.delete("job/0/0.safetensors")
    dest.delete("job/0/0.safetensors")
    assert not dest.has_verified("job/0/0.safetensors", size=12, digest="d1")
    probe(dest, "job/_hsx/probe")
    assert "job/_hsx/probe" not in set(dest.keys())


def test_refusals_name_the_cause_and_never_the_key(azurite, az_env, monkeypatch):
    """A missing container and a wrong account key are refusals (no retry fixes them), worded in
    one line without the key; no credentials at all is a one-line error when the destination opens."""
    missing = open_destination(Location.parse("az://no-such-container/p"), max_connections=1)
    with pytest.raises(Exception) as raised:
        missing.put_bytes_verified(b"x", "k")
    assert missing.refusal(raised.value).startswith("az://no-such-container/p: ContainerNotFound")
    wrong = "A" * 86 + "=="
    monkeypatch.setenv(azure.CONNECTION_STRING, azurite.connection_string.replace(DEV_KEY, wrong))
    refused = open_destination(Location.parse(f"az://{az_env}/p"), max_connections=1)
    for call in (lambda: refused.put_bytes_verified(b"x", "k"), lambda: refused.has_sha256("k", size=1, sha256="")):
        with pytest.raises(Exception) as raised:
            call()
        reason = refused.refusal(raised.value)
        assert reason.startswith(f"az://{az_env}/p: AuthorizationFailure"), reason
        assert wrong not in reason and "\n" not in reason
    monkeypatch.delenv(azure.CONNECTION_STRING)
    with pytest.raises(HsxError, match=r"^az://box/p: no Azure credentials: set AZURE_STORAGE_CONNECTION_STRING"):
        open_destination(Location.parse("az://box/p"))


def test_without_the_extra_an_az_destination_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "azure.storage.blob", None)  # as if not installed: import fails
    with pytest.raises(
        HsxError, match=r"^az://box/p: Azure Blob Storage needs its client: pip install 'hsx-extract\[azure\]'$"
    ):
        open_destination(Location.parse("az://box/p"))


def test_an_account_url_with_a_sas_is_enough(azurite, az_env, monkeypatch):
    """AZURE_STORAGE_ACCOUNT_URL with a SAS in its query: no key, no identity; without a SAS the
    client asks azure-identity's DefaultAzureCredential (not reachable here: only chosen)."""
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    sas = generate_account_sas(
        ACCOUNT,
        DEV_KEY,
        resource_types=ResourceTypes(service=True, container=True, object=True),
        permission=AccountSasPermissions(read=True, write=True, delete=True, list=True, add=True, create=True),
        expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1),
    )
    monkeypatch.delenv(azure.CONNECTION_STRING)
    monkeypatch.setenv(azure.ACCOUNT_URL, f"{azurite.endpoint}?{sas}")
    probe(open_destination(Location.parse(f"az://{az_env}/p"), max_connections=1), "probe")
    assert type(azure._url_credential("https://acct.blob.core.windows.net")).__name__ == "DefaultAzureCredential"


def test_config_show_hides_the_connection_string(azurite, monkeypatch):
    monkeypatch.setenv(azure.CONNECTION_STRING, azurite.connection_string)
    code, out, _ = run_cli("config", "show", "--json", "upload", "--job", "j")
    assert code == 0 and DEV_KEY not in out
    assert json.loads(out)["environment"][azure.CONNECTION_STRING] != azurite.connection_string


@pytest.fixture(scope="module")
def az_job(nats_server, azurite, tiny_model, tmp_path_factory):
    """A finished job in az://<container>/prefix, AZURE_STORAGE_CONNECTION_STRING set in this process too."""
    tmp = tmp_path_factory.mktemp("az-job")
    services = Services(nats_server.url, tmp)
    env = {azure.CONNECTION_STRING: azurite.connection_string}
    container = new_container(azurite.connection_string)
    job = f"az{uuid.uuid4().hex[:8]}"
    rows = write_dataset(tmp / "data.jsonl", COUNT, min_len=3, max_len=60, seed=7)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(azure.CONNECTION_STRING, azurite.connection_string)
        try:
            check_ok(
                services.hsx(
                    *(
                        "produce",
                        "--job",
                        job,
                        "--model",
                        str(tiny_model("qwen3")),
                        "--dataset",
                        str(tmp / "data.jsonl"),
                    ),
                    *("--layers", ",".join(map(str, LAYERS)), "--dest", f"az://{container}/prefix"),
                    *("--token-budget", "256", "--max-seq-len", "128"),
                    env=env,
                ),
                "hsx produce",
            )
            spool = tmp / "spool"
            workers = [
                services.service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), env=env),
                services.service("upload", "--job", job, "--spool", str(spool), env=env, name="upload"),
            ]
            wait_until_done(start_monitor(services.service, job, env), workers)
        finally:
            services.stop_all()
        yield SimpleNamespace(job=job, rows=rows, url=f"az://{container}/prefix/{job}", nats_url=nats_server.url)


READER_SCRIPT = """
import sys
from hsx.storage.reader import HiddenStateDataset, JobStream, PrefetchedBatches, TokenBudgetSampler

url, nats = sys.argv[1:]
dataset = HiddenStateDataset(url)
read = sum(len(batch["sample_index"]) for batch in PrefetchedBatches(dataset, TokenBudgetSampler(dataset, token_budget=256)))
streamed = sum(len(batch["sample_index"]) for batch in JobStream(url, nats=nats, token_budget=256))
print(f"read {read}, streamed {streamed}, tokens {sum(len(dataset[i]['input_ids']) for i in range(len(dataset)))}")
"""


def test_a_job_in_azure_reads_back_everywhere_s3_does(az_job, tmp_path):
    """The uploader put every sample (checked by `hsx verify`, which reads each one); the index
    rebuilt from the container alone; HiddenStateDataset with its sampler and JobStream in a
    training script of their own; `hsx export` straight from the container."""
    code, out, err = run_cli("verify", "--job", az_job.job, "--nats", az_job.nats_url, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] is True and report["samples_checked"] == COUNT, (report, err[-2000:])

    code, out, err = run_cli("index", "rebuild", az_job.url, "--json")
    assert code == 0 and json.loads(out)["samples"] == COUNT, err[-2000:]

    script = subprocess.run(
        [sys.executable, "-c", READER_SCRIPT, az_job.url, az_job.nats_url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    tokens = sum(len(row["input_ids"]) for row in az_job.rows)
    assert script.stdout == f"read {COUNT}, streamed {COUNT}, tokens {tokens}\n", script.stderr[-3000:]

    from hsx.commands.export import ExportConfig, run_export

    exported = run_export(
        ExportConfig(source=Location.parse(az_job.url), to="specforge-dflash", out=tmp_path / "dflash", workers=4)
    )
    assert exported.ok and exported.samples_exported + len(exported.left_out) == COUNT, exported
    assert len(list((tmp_path / "dflash").rglob("*.ckpt"))) == exported.samples_exported > 0


def test_sync_uploads_a_directory_to_azure(az_env, tmp_path):
    source = tmp_path / "checkpoints"
    (source / "step-1").mkdir(parents=True)
    (source / "step-1" / "model.bin").write_bytes(b"weights" * 1000)
    (source / "log.txt").write_text("loss 1.0\n")
    code, _, err = run_cli("sync", str(source), "--dest", f"az://{az_env}/runs", "--once")
    assert code == 0, err[-2000:]
    dest = open_destination(Location.parse(f"az://{az_env}/runs"), max_connections=1)
    assert sorted(dest.keys()) == ["log.txt", "step-1/model.bin"]
    assert dest.read_bytes("step-1/model.bin") == b"weights" * 1000
