"""A destination that refuses uploads: a missing bucket, wrong credentials, a denied permission, a
file where a directory of a file:// destination belongs. Each is reported within a minute as the
job's failure (`hsx status --json` `failed` with `failure_reason`, the monitor's
`destination_failed` and `job_failed` with exit 65, `hsx up` exit 65 naming it); the files stay in
the spool, no event is redelivered, and the uploader resumes by itself once the destination is
fixed: every sample uploaded exactly once.

Everything is real: moto S3 over HTTP, for the credential cases a moto server of its own with
IAM authentication switched on (it checks signatures, access key ids and user policies: real
SignatureDoesNotMatch, InvalidAccessKeyId and AccessDenied answers), nats-server, a tiny qwen3
model, every hsx service a subprocess. The classification is checked on the exceptions real
calls raise, the retry jitter on the delays it draws.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import botocore.config
import pytest
import requests
from conftest import _free_port, clean_environ
from test_chaos import check_uploaded_once, log_events, wait_for
from test_e2e_s3 import (
    check_final_status,
    check_outputs,
    logs_of,
    produce,
    spool_files,
    start_monitor,
    status,
    wait_until_done,
    write_dataset,
)

from hsx.exitcodes import JOB_FAILED
from hsx.job import JobSpec
from hsx.storage.destinations.file import FileDestination
from hsx.storage.destinations.s3 import S3Destination
from hsx.wire import schemas
from hsx.wire.backoff import jittered, retry_delay
from hsx.wire.counts import ProgressCounts, QueueState
from hsx.wire.fold import ProgressFold
from hsx.wire.statusview import DestinationRefusal, StatusView, status_view

PROBE = ("--probe-every", "1")  # the uploader tries a refusing destination again every ~1 s


# ---------------------------------------------------------------- a moto server that checks credentials


@dataclass(frozen=True)
class AuthS3:
    url: str
    admin: tuple[str, str]  # access key id, secret: may do anything, IAM included
    user: tuple[str, str]  # the job's key: S3 only, through the user policy POLICY_NAME
    user_name: str = "hsx-uploader"

    def client(self, service: str, key: tuple[str, str] | None = None):
        key_id, secret = key or self.admin
        return boto3.client(
            service,
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
            config=botocore.config.Config(s3={"addressing_style": "path"}),
        )

    def allow_s3(self, allowed: bool) -> None:
        iam = self.client("iam")
        if allowed:
            iam.put_user_policy(UserName=self.user_name, PolicyName=POLICY_NAME, PolicyDocument=_ALLOW_S3)
        else:
            iam.delete_user_policy(UserName=self.user_name, PolicyName=POLICY_NAME)

    def env(self, tmp_path: Path, key: tuple[str, str] | None = None) -> dict[str, str]:
        key_id, secret = key or self.user
        return {
            "AWS_ENDPOINT_URL_S3": self.url,
            "AWS_ACCESS_KEY_ID": key_id,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials"),
        }


POLICY_NAME = "s3-access"
_ALLOW_S3 = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})
_ALLOW_ALL = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})


@pytest.fixture(scope="module")
def auth_s3(tmp_path_factory):
    """A moto server in a process of its own (IAM authentication is a server-wide switch, which
    must not reach the session's moto server), with an admin, a job user allowed S3, and from then
    on every request checked against them."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto-auth") / "moto.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(f"{url}/moto-api/", timeout=1)
                break
            except requests.ConnectionError:
                assert process.poll() is None and time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.1)
        iam = boto3.client(
            "iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="setup", aws_secret_access_key="setup"
        )
        keys = {}
        for name, policy in (("hsx-admin", _ALLOW_ALL), ("hsx-uploader", _ALLOW_S3)):
            iam.create_user(UserName=name)
            iam.put_user_policy(UserName=name, PolicyName=POLICY_NAME, PolicyDocument=policy)
            created = iam.create_access_key(UserName=name)["AccessKey"]
            keys[name] = (created["AccessKeyId"], created["SecretAccessKey"])
        # From now on moto checks every request's signature, key id and the user's policies.
        requests.post(f"{url}/moto-api/reset-auth", data=b"0", timeout=5).raise_for_status()
        yield AuthS3(url=url, admin=keys["hsx-admin"], user=keys["hsx-uploader"])
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


# ---------------------------------------------------------------- classification, on real errors


def _error_of(call) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    pytest.fail("the call succeeded; expected the destination to refuse it")


def test_refusals_are_told_from_other_errors_on_what_real_s3_calls_raise(auth_s3, tmp_path, monkeypatch):
    bucket = f"hsx-{uuid.uuid4().hex[:10]}"
    auth_s3.client("s3").create_bucket(Bucket=bucket)
    wrong_secret = "wrong-secret-that-must-never-be-shown"
    big = tmp_path / "big.bin"
    with open(big, "wb") as sparse:  # past the multipart threshold without writing 65 MiB
        sparse.truncate(65 << 20)

    def destination(key: tuple[str, str], bucket_name: str = bucket) -> S3Destination:
        for name, value in auth_s3.env(tmp_path, key).items():
            monkeypatch.setenv(name, value)
        return S3Destination(bucket_name, "prefix")

    missing = destination(auth_s3.user, "hsx-no-such-bucket")
    cases = [
        # a missing bucket: PUT names it; a multipart upload wraps it in boto3's S3UploadFailedError
        ("NoSuchBucket", missing, lambda d: d.put_bytes_verified(b"x", "k")),
        ("NoSuchBucket", missing, lambda d: d.put_file_verified(big, "k", size=65 << 20, sha256="0" * 64)),
        # a HEAD refused with a bare 403: the destination asks again with a GET to name the cause
        (
            "SignatureDoesNotMatch",
            destination((auth_s3.user[0], wrong_secret)),
            lambda d: d.has_verified("k", size=1, digest="d"),
        ),
        (
            "InvalidAccessKeyId",
            destination(("AKIANOSUCHKEY0000000", wrong_secret)),
            lambda d: d.put_bytes_verified(b"x", "k"),
        ),
    ]
    for code, dest, call in cases:
        exc = _error_of(lambda: call(dest))
        reason = dest.refusal(exc)
        assert reason is not None, f"{code}: {type(exc).__name__}: {exc} not taken for a refusal"
        assert code in reason and dest.url in reason and wrong_secret not in reason, reason
        assert "\n" not in reason and len(reason) <= 300, reason

    auth_s3.allow_s3(False)
    try:
        dest = destination(auth_s3.user)
        for call in (lambda: dest.put_bytes_verified(b"x", "k"), lambda: dest.has_verified("k", size=1, digest="d")):
            reason = dest.refusal(_error_of(call))
            assert reason is not None and "AccessDenied" in reason and auth_s3.user[1] not in reason, reason
    finally:
        auth_s3.allow_s3(True)

    # Not refusals: a key that is not there, and errors of the spool rather than the destination.
    dest = destination(auth_s3.user)
    assert dest.has_verified("absent", size=1, digest="d") is False
    exc = _error_of(lambda: dest.read_bytes("absent"))
    assert dest.refusal(exc) is None, exc
    exc = _error_of(lambda: dest.put_verified(tmp_path / "not-in-spool.safetensors", "k", size=1, digest="d"))
    assert isinstance(exc, FileNotFoundError) and dest.refusal(exc) is None


def test_file_destination_refuses_only_for_its_own_paths(tmp_path):
    root = tmp_path / "out"
    dest = FileDestination(root)
    (root / "job").mkdir(parents=True)
    (root / "job" / "00000").write_bytes(b"a file where a shard directory belongs")
    sample = tmp_path / "spool" / "0.safetensors"
    sample.parent.mkdir()
    sample.write_bytes(b"x" * 10)
    for call in (
        lambda: dest.put_verified(sample, "job/00000/0.safetensors", size=10, digest="d"),
        lambda: dest.has_verified("job/00000/0.safetensors", size=10, digest="d"),
    ):
        exc = _error_of(call)
        reason = dest.refusal(exc)
        assert isinstance(exc, NotADirectoryError) and reason is not None, exc
        assert reason.startswith(dest.url) and "Not a directory" in reason, reason
    # The same error on a spool path is not the destination's.
    blocked = tmp_path / "spool" / "0.safetensors" / "x"
    exc = _error_of(lambda: dest.put_verified(blocked, "job/1.safetensors", size=10, digest="d"))
    assert isinstance(exc, NotADirectoryError) and dest.refusal(exc) is None, exc


def test_retry_delays_of_many_uploads_failing_together_are_spread():
    rng = random.Random(5)
    for attempt, ceiling in ((0, 1.0), (3, 8.0), (10, 30.0)):
        delays = [retry_delay(attempt, base_s=1.0, cap_s=30.0, rng=rng) for _ in range(100)]
        assert all(0 <= d <= ceiling for d in delays), (attempt, max(delays))
        # A hundred uploads retrying after one outage: spread over the step, not one burst.
        assert len({round(d, 3) for d in delays}) >= 95, attempt
        assert max(delays) - min(delays) > 0.8 * ceiling and statistics.pstdev(delays) > 0.2 * ceiling, attempt
    probes = [jittered(30.0, rng=rng) for _ in range(100)]
    assert all(22.5 <= p <= 37.5 for p in probes) and max(probes) - min(probes) > 10


def test_a_refusal_fails_the_job_only_while_a_live_uploader_says_so():
    spec = JobSpec(
        job="j",
        model="m",
        model_revision="r",
        layers=[1],
        dtype="bfloat16",
        dest="s3://b/p",
        token_budget=64,
        max_seq_len=32,
        dataset="d",
        plan_fingerprint="f",
        total_samples=2,
        total_tokens=20,
        total_batches=1,
        created_at=0.0,
        published=True,
    )
    reason = "s3://b/p: NoSuchBucket (The specified bucket does not exist) on PutObject"

    def view(state: str, age_s: float, **queued) -> StatusView:
        fold = ProgressFold()
        fold.apply(
            schemas.Heartbeat(
                job="j",
                service="uploader",
                instance="u-1",
                node="n",
                state=state,
                detail=reason if state == "refused" else "",
                sent_at=1000.0 - age_s,
            )
        )
        return status_view(spec, fold, QueueState(**queued), ProgressCounts(), job="j", now=1000.0, live_s=30.0)

    refused = view("refused", 5.0, files_queued=2, files_in_hand=2)
    # Files queued that no uploader holds (none took them up): one heartbeat's word alone.
    assert not view("refused", 5.0, files_queued=2).failed
    assert refused.failed and refused.destination_error == reason, refused
    assert refused.failure_reason == f"the destination refuses uploads: {reason}", refused
    assert refused.destination_refusals == [DestinationRefusal(uploader="u-1", node="n", reason=reason)], refused
    # Silent for longer than live_s (killed), said goodbye, or working again: no failure.
    for state, age_s in (("refused", 31.0), ("stopping", 1.0), ("working", 1.0)):
        quiet = view(state, age_s, files_queued=2, files_in_hand=2)
        assert not quiet.failed and quiet.failure_reason is None and quiet.destination_refusals == [], quiet
    # One uploader's word alone while another live uploader works (or idles), or while a consumer
    # works: the refusal is shown, the job has not failed (issue 35, item 9).
    for service, instance, state in (("uploader", "u-2", "idle"), ("gpu_consumer", "c-1", "working")):
        fold = ProgressFold()
        for beat_service, beat_instance, beat_state in (("uploader", "u-1", "refused"), (service, instance, state)):
            fold.apply(
                schemas.Heartbeat(
                    job="j",
                    service=beat_service,
                    instance=beat_instance,
                    node="n",
                    state=beat_state,
                    detail=reason,
                    sent_at=995.0,
                )
            )
        queues = QueueState(files_queued=2, files_in_hand=2)
        outvoted = status_view(spec, fold, queues, ProgressCounts(), job="j", now=1000.0)
        assert not outvoted.failed and outvoted.destination_error == reason, (service, outvoted)


# ---------------------------------------------------------------- whole jobs


def _sample_count(spool: Path) -> int:
    return sum(1 for p in spool_files(spool) if p.suffix == ".safetensors" and not p.name.startswith("."))


def _secret_free(secret: str, *procs, texts=()) -> None:
    for proc in procs:
        assert secret not in Path(proc.log_path).read_text(errors="replace"), f"secret in {proc.log_path}"
    for text in texts:
        assert secret not in text


def test_missing_bucket_fails_the_job_within_a_minute_and_the_uploader_resumes_once_it_exists(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name, s3_env, caplog
):
    caplog.set_level("WARNING", logger="werkzeug")
    bucket, env = s3_env
    job = job_name
    rows = write_dataset(tmp_path / "data.jsonl", 12, min_len=8, max_len=40, seed=81)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=f"s3://{bucket}/prefix",
        token_budget=128,
        max_seq_len=64,
        env=env,
    )
    client = boto3.client("s3")
    # The bucket goes away after the job was published (with its bundle): every upload meets NoSuchBucket.
    for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=bucket)

    spool = tmp_path / "spool"
    consumer = hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), env=env, name="consume")
    uploader = hsx_service(
        "upload", "--job", job, "--spool", str(spool), "--ack-wait", "5", *PROBE, env=env, name="upload"
    )
    started = time.monotonic()
    monitor = start_monitor(hsx_service, job, env)
    services = [consumer, uploader, monitor]
    wait_for(
        lambda: monitor.poll() is not None,
        timeout=60,
        what="monitor --until-done to give up",
        procs=services,
        alive=[consumer, uploader],
    )
    reported_s = time.monotonic() - started
    assert monitor.returncode == JOB_FAILED, logs_of(*services)
    failed = log_events(monitor, "job_failed")
    assert failed and bucket in failed[-1]["reason"] and "NoSuchBucket" in failed[-1]["reason"], logs_of(monitor)
    said = log_events(monitor, "destination_failed")
    assert said and bucket in said[0]["reason"], logs_of(monitor)

    # The failure rests on live heartbeats and JetStream's count of files in hand, read a moment
    # after the monitor's: on a loaded machine a consumer's last `working` beat can still be live
    # then (seen once in a full run), so the view is read until it agrees, briefly.
    views = []
    wait_for(
        lambda: views.append(status(hsx, job, env)) or views[-1]["failed"],
        timeout=20,
        what="hsx status to say failed",
        procs=services,
        period=0.5,
    )
    view = views[-1]
    assert view["failed"] is True and view["done"] is False, view
    assert f"s3://{bucket}/prefix" in view["failure_reason"] and "NoSuchBucket" in view["destination_error"], view
    assert view["destination_refusals"][0]["node"] == "testnode", view

    # Everything is extracted meanwhile and waits in the spool; the uploader keeps probing.
    wait_for(
        lambda: status(hsx, job, env)["samples_written"] == len(rows),
        timeout=60,
        what="every sample written",
        procs=services,
        alive=[consumer, uploader],
        period=0.5,
    )
    assert _sample_count(spool) == len(rows), spool_files(spool)
    wait_for(
        lambda: log_events(uploader, "destination_still_refused"),
        timeout=10,
        what="a probe refused",
        procs=services,
        alive=[uploader],
    )

    client.create_bucket(Bucket=bucket)
    fixed = time.monotonic()
    # Until the uploader's next probe gets through, the job still shows failed: wait for it.
    wait_for(
        lambda: log_events(uploader, "destination_accepts"),
        timeout=10,
        what="the uploader resuming",
        procs=services,
        alive=[consumer, uploader],
    )
    resumed_s = time.monotonic() - fixed
    monitor = start_monitor(hsx_service, job, env)
    wait_until_done(monitor, [consumer, uploader], timeout=60)
    fixed_to_done_s = time.monotonic() - fixed
    objects = {
        obj["Key"][len("prefix/") :]: client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        for obj in client.list_objects_v2(Bucket=bucket).get("Contents", [])
    }
    check_outputs(objects, job=job, rows=rows)
    assert not spool_files(spool), spool_files(spool)
    view = status(hsx, job, env)
    check_final_status(view, total=len(rows))
    assert view["failed"] is False and view["failure_reason"] is None and view["destination_error"] is None, view
    # Held and kept alive through the refusal: no event redelivered, nothing extracted twice.
    assert view["file_redeliveries"] == 0 and view["samples_requeued"] == 0, view
    check_uploaded_once(nats_server.url, job, len(rows))
    _secret_free(env["AWS_SECRET_ACCESS_KEY"], *services, monitor)
    print(
        f"\nREFUSAL missing_bucket: reported_after_s={reported_s:.1f} bucket_created_to_resumed_s={resumed_s:.1f} "
        f"bucket_created_to_done_s={fixed_to_done_s:.1f}"
    )


def test_wrong_credentials_then_a_denied_permission_are_reported_and_fixing_them_resumes_the_uploader(
    tmp_path, hsx, hsx_service, nats_server, tiny_model, job_name, auth_s3, monkeypatch
):
    job = job_name
    bucket = f"hsx-{uuid.uuid4().hex[:10]}"
    auth_s3.client("s3").create_bucket(Bucket=bucket)
    good = auth_s3.env(tmp_path)
    rows = write_dataset(tmp_path / "data.jsonl", 10, min_len=8, max_len=40, seed=82)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=f"s3://{bucket}/prefix",
        token_budget=128,
        max_seq_len=64,
        env=good,
    )

    # The uploader takes its key from the credentials file, which the operator fixes in place.
    credentials = tmp_path / "uploader-credentials"
    wrong_secret = "not-the-secret-" + uuid.uuid4().hex

    def write_credentials(secret: str) -> None:
        credentials.write_text(f"[default]\naws_access_key_id = {auth_s3.user[0]}\naws_secret_access_key = {secret}\n")

    write_credentials(wrong_secret)
    uploader_env = {
        **good,
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": str(credentials),
    }
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    spool = tmp_path / "spool"
    consumer = hsx_service("consume", "--job", job, "--device", "cpu", "--spool", str(spool), name="consume")
    uploader = hsx_service(
        "upload", "--job", job, "--spool", str(spool), "--ack-wait", "5", *PROBE, env=uploader_env, name="upload"
    )
    services = [consumer, uploader]
    started = time.monotonic()

    def refusal(code: str):
        view = status(hsx, job, None)
        return view if view["failed"] and code in (view["destination_error"] or "") else None

    wait_for(
        lambda: refusal("SignatureDoesNotMatch"),
        timeout=60,
        what="status failed: SignatureDoesNotMatch",
        procs=services,
        alive=services,
        period=0.5,
    )
    reported_s = time.monotonic() - started

    # The key is fixed in the file, but the user's S3 permission is gone: the next probe reads the
    # file again and the reason becomes AccessDenied.
    auth_s3.allow_s3(False)
    write_credentials(auth_s3.user[1])
    view = None

    def denied():
        nonlocal view
        view = refusal("AccessDenied")
        return view

    wait_for(denied, timeout=30, what="status failed: AccessDenied", procs=services, alive=services, period=0.5)
    assert f"s3://{bucket}/prefix" in view["failure_reason"], view
    wait_for(
        lambda: status(hsx, job, None)["samples_written"] == len(rows),
        timeout=60,
        what="every sample written",
        procs=services,
        alive=services,
        period=0.5,
    )
    assert _sample_count(spool) == len(rows), spool_files(spool)

    auth_s3.allow_s3(True)
    fixed = time.monotonic()
    wait_for(
        lambda: log_events(uploader, "destination_accepts"),
        timeout=10,
        what="the uploader resuming",
        procs=services,
        alive=services,
    )
    monitor = start_monitor(hsx_service, job, None)
    wait_until_done(monitor, services, timeout=60)
    fixed_to_done_s = time.monotonic() - fixed
    admin = auth_s3.client("s3")
    objects = {
        obj["Key"][len("prefix/") :]: admin.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        for obj in admin.list_objects_v2(Bucket=bucket).get("Contents", [])
    }
    check_outputs(objects, job=job, rows=rows)
    assert not spool_files(spool), spool_files(spool)
    view = status(hsx, job, None)
    check_final_status(view, total=len(rows))
    assert not view["failed"] and view["file_redeliveries"] == 0 and view["samples_requeued"] == 0, view
    check_uploaded_once(nats_server.url, job, len(rows))
    for secret in (wrong_secret, auth_s3.user[1]):
        _secret_free(secret, uploader, monitor)
    print(f"\nREFUSAL credentials: reported_after_s={reported_s:.1f} permission_back_to_done_s={fixed_to_done_s:.1f}")


def test_hsx_up_exits_1_naming_a_refusing_destination_and_leaves_no_stale_failure(
    tmp_path, hsx, nats_server, tiny_model, job_name
):
    workdir, out, job = tmp_path / "work", tmp_path / "out", job_name
    blocker = out / job / "00000"  # a file where the first shard's directory belongs
    blocker.parent.mkdir(parents=True)
    blocker.write_bytes(b"not a directory")
    args = [
        sys.executable,
        "-m",
        "hsx.cli",
        "up",
        "--workdir",
        str(workdir),
        "--nats",
        nats_server.url,
        "--job",
        job,
        "--model",
        str(tiny_model("qwen3")),
        "--dest",
        str(out),
        "--samples",
        "8",
        "--layers",
        "1,3",
        "--token-budget",
        "1024",
        "--max-seq-len",
        "128",
    ]
    env = {**clean_environ(), "PYTHONUNBUFFERED": "1", "HSX_PROBE_EVERY": "1"}

    run = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == JOB_FAILED, run.stderr[-3000:]
    error = [line for line in run.stderr.splitlines() if line.startswith("hsx: error:")]
    assert error and "the destination refuses uploads" in error[-1] and str(blocker) in error[-1], run.stderr[-3000:]
    assert "Not a directory" in error[-1] and "run hsx up again" in error[-1], error
    assert "failure  the destination refuses uploads" in run.stdout, run.stdout[-2000:]
    # The spooled files wait for the next run; the uploaders said goodbye, so their refusal went
    # with them: a run after the fix (or a monitor started now) does not begin failed.
    spooled = list((workdir / "spool").rglob("*.safetensors"))
    view = status(hsx, job, None)
    assert len(spooled) == view["samples_written"] == 8 and view["samples_uploaded"] == 0, (spooled, view)
    assert view["failed"] is False and view["failure_reason"] is None and view["destination_refusals"] == [], view
