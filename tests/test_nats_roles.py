"""Least privilege on NATS: a nats-server started with what `hsx nats-config` writes (one user
per role, each allowed only its role's subjects), and a job run with each role's own
credentials: produce, a batch dead-lettered by the consumer's own reaper and sent back with
`hsx dead retry`, consume on the CPU, upload to a local folder, `monitor --until-done`, status,
a trainer's JobStream, `hsx jobs delete`; none of it meets a permission violation. A consumer's
credentials cannot purge a stream, write the jobs bucket or publish another job's batch (the
server refuses, the data stays), and a worker run with another role's credentials stops with one
line naming what was refused. No role can erase a message with a `Nats-Rollup` header on any
subject it may publish. A trainer may record any stream's epoch end of its job, and a
forged one is refused by the stream's ranks; with a trainer user per stream (`--trainer-stream`)
the server refuses it, and the stream it aimed at ends where the job does."""

import asyncio
import json
import os
import stat
import uuid

import nats
import nats.errors
import nats.js.errors
import pytest
from conftest import _free_port
from test_cli_errors import assert_one_line_error
from test_e2e_s3 import check_outputs, read_dir_objects, write_dataset
from test_jobstream import (
    _end_record,
    _fake_job,
    _Following,
    _marker_sequences,
    _publish_records,
    _Reading,
    _records_on,
    _samples_of,
)

from hsx.commands.configs import NatsConfigConfig
from hsx.commands.embedded import start_nats_server
from hsx.commands.natsconfig import AUTH_FILE, env_file, write_nats_config
from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.storage.reader import JobStream
from hsx.wire import permissions, schemas, topology
from hsx.wire.denials import PermissionDenied
from hsx.wire.events import EventPublisher
from hsx.wire.exhausted import dead_letter_exhausted
from hsx.wire.natsconn import NatsSettings, close_connection, connect

NODE = "rolenode"
# The jobs the configuration allows; another job's subjects are refused to every role. Each test
# produces its own: xdist may run a module's tests on different workers, each with its own server.
RUN_JOB, REFUSED_JOB, WRONG_ROLE_JOB, OTHER_JOB, FORGED_JOB, ROLLUP_JOB = (f"r{uuid.uuid4().hex[:8]}" for _ in range(6))
STREAM_JOB = f"r{uuid.uuid4().hex[:8]}"


def _read_env(path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    """A server that knows only the roles' users, and each role's environment (HSX_NATS_*)."""
    root = tmp_path_factory.mktemp("roles")
    out = root / "nats-config"
    write_nats_config(
        NatsConfigConfig(
            out=out, jobs=(RUN_JOB, REFUSED_JOB, WRONG_ROLE_JOB, FORGED_JOB, ROLLUP_JOB), nodes=(NODE,), bcrypt_cost=4
        )
    )
    server = start_nats_server(root / "server", log_file=root / "server.log", extra_args=("-c", str(out / AUTH_FILE)))
    envs = {role: {**_read_env(out / env_file(role)), "HSX_NATS_URL": server.url} for role in permissions.ROLES}
    yield server, envs, root / "server.log"
    server.stop()


def _violations(log_path) -> list[str]:
    return [line for line in log_path.read_text(errors="replace").splitlines() if "Violation" in line]


def _settings(env: dict[str, str]) -> NatsSettings:
    return NatsSettings.from_env(env)


def _produce(hsx, env, tmp_path, tiny_model, job: str, rows: int = 10) -> tuple[list[dict], str]:
    data = tmp_path / f"{job}.jsonl"
    written = write_dataset(data, rows, min_len=4, max_len=24, seed=3)
    dest = tmp_path / "out"
    result = hsx(
        "produce",
        *("--job", job, "--model", str(tiny_model("qwen3")), "--dataset", str(data), "--layers", "0,2,5"),
        *("--dest", str(dest), "--dtype", "float32", "--token-budget", "64", "--max-seq-len", "32"),
        env=env,
        nats_url=env["HSX_NATS_URL"],
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return written, str(dest)


async def _dead_letter_first_batch(env: dict[str, str], job: str) -> int:
    """Take the job's first batch out of the queue as the consumer's reaper does with one that
    used up its deliveries, with the consumer's own credentials; its stream sequence."""
    nc = await connect(_settings(env), name="test-reaper")
    try:
        js = nc.jetstream()
        first = await js.get_msg(topology.BATCHES_STREAM, seq=1, subject=topology.batch_subject(job), next=True)
        assert await dead_letter_exhausted(js, EventPublisher(nc, js, job), seq=first.seq, deliveries=5)
        return first.seq
    finally:
        await close_connection(nc)


def test_a_job_runs_end_to_end_with_each_roles_own_credentials(roles, hsx, hsx_service, tmp_path, tiny_model):
    server, envs, log_path = roles
    job = RUN_JOB
    violations_before = len(_violations(log_path))

    def run(role: str, *args: str, **kwargs):
        return hsx(*args, env=envs[role], nats_url=server.url, **kwargs)

    rows, dest = _produce(hsx, envs["producer"], tmp_path, tiny_model, job)
    asyncio.run(_dead_letter_first_batch(envs["consumer"], job))
    listed = run("monitor", "dead", "list", "--job", job, "--json")
    assert listed.returncode == 0, listed.stderr
    [letter] = json.loads(listed.stdout)
    assert letter["what"] == "batch" and letter["samples"] and not letter["resolved"]
    retried = run("admin", "dead", "retry", "--job", job, "--all", "--json")
    assert retried.returncode == 0, retried.stderr
    assert [entry["seq"] for entry in json.loads(retried.stdout)] == [letter["seq"]]

    spool = str(tmp_path / "spool")
    worker_env = {"HSX_NODE": NODE}
    consumer = hsx_service(
        "consume",
        *("--job", job, "--device", "cpu", "--spool", spool, "--until-done"),
        env={**envs["consumer"], **worker_env},
        name="consumer",
    )
    uploader = hsx_service(
        "upload",
        "--job",
        job,
        "--spool",
        spool,
        "--until-done",
        env={**envs["uploader"], **worker_env},
        name="uploader",
    )
    # With its page too: every reading the page makes (marker times, files per node, the jobs
    # bucket's names) is the monitor role's to make.
    monitor = run(
        *("monitor", "monitor", "--job", job, "--until-done", "--interval", "0.5", "--http", str(_free_port())),
        timeout=180,
    )
    assert monitor.returncode == 0, (monitor.stdout + monitor.stderr)[-3000:]
    assert '"page_serving"' in monitor.stdout and '"page_not_updated"' not in monitor.stdout, monitor.stdout[-3000:]
    for worker in (consumer, uploader):
        assert worker.wait(timeout=60) == 0, worker.log_path.read_text()[-3000:]
    check_outputs(read_dir_objects(tmp_path / "out"), job=job, rows=rows)

    status = run("monitor", "status", "--job", job, "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["done"] and view["samples_uploaded"] == len(rows) and view["dead_letters"] == 0
    jobs = run("monitor", "jobs", "list", "--json")
    assert jobs.returncode == 0 and job in {row["job"] for row in json.loads(jobs.stdout)}, jobs.stderr

    stream = JobStream(f"{dest}/{job}", nats=_settings(envs["trainer"]), name="trainer", token_budget=256)
    assert sorted(_samples_of(_Reading(stream).result(timeout=60))) == list(range(len(rows)))
    assert stream.first_epoch is not None and stream.first_epoch.done

    deleted = run("admin", "jobs", "delete", job, "--json")
    assert deleted.returncode == 0, deleted.stderr
    assert json.loads(deleted.stdout)["spec"]
    after = run("monitor", "jobs", "list", "--json")
    assert job not in {row["job"] for row in json.loads(after.stdout)}
    # Every role had exactly what it needed: the server refused nothing.
    assert _violations(log_path)[violations_before:] == []


async def _try_as(env: dict[str, str], operations) -> tuple[list[str], dict]:
    """Run each (name, operation(js, kv)) with the role's user; the permission violations the
    server reported, and per operation what it raised."""
    denied: list[str] = []

    async def on_error(exc: BaseException) -> None:
        denied.append(str(exc))

    settings = _settings(env)
    nc = await nats.connect(settings.url, error_cb=on_error, max_reconnect_attempts=0, **settings.connect_options())
    try:
        js = nc.jetstream(timeout=1.0)
        kv = await js.key_value(topology.JOBS_BUCKET)
        raised = {}
        for name, operation in operations:
            try:
                await operation(js, kv)
                raised[name] = None
            except (nats.errors.TimeoutError, TimeoutError) as exc:
                raised[name] = exc
        return denied, raised
    finally:
        await nc.close()


async def _state(env: dict[str, str], job: str) -> tuple[int, bytes]:
    nc = await connect(_settings(env), name="test-state")
    try:
        js = nc.jetstream()
        info = await js.stream_info(topology.BATCHES_STREAM, subjects_filter=topology.batch_subject(job))
        spec = await (await js.key_value(topology.JOBS_BUCKET)).get(job)
        return sum((info.state.subjects or {}).values()), spec.value
    finally:
        await close_connection(nc)


async def _first_batch(env: dict[str, str], job: str) -> bytes:
    """The payload of the job's first queued descriptor, read without consuming it."""
    nc = await connect(_settings(env), name="test-first-batch")
    try:
        js = nc.jetstream()
        first = await js.get_msg(topology.BATCHES_STREAM, seq=1, subject=topology.batch_subject(job), next=True)
        assert schemas.batch_decoder.decode(first.data).job == job
        return first.data
    finally:
        await close_connection(nc)


def test_a_consumers_credentials_cannot_purge_write_specs_or_publish_batches(roles, hsx, tmp_path, tiny_model):
    """The server refuses a consumer's purge of a stream, its writes to the jobs bucket, its
    deletion of a durable and its publish of a batch on another job's subject (a descriptor the
    producer published, sent again), and the monitor's publish of a batch on its own job's: none
    of it happens."""
    server, envs, _ = roles
    job = REFUSED_JOB
    _produce(hsx, envs["producer"], tmp_path, tiny_model, job, rows=6)
    batches, spec = asyncio.run(_state(envs["admin"], job))
    assert batches > 0
    # A descriptor the producer published (a valid one: what the server refuses is the subject,
    # whatever the payload), sent again where the role may not publish.
    planned = asyncio.run(_first_batch(envs["admin"], job))
    operations = [
        ("purge", lambda js, kv: js.purge_stream(topology.BATCHES_STREAM)),
        ("purge_job", lambda js, kv: js.purge_stream(topology.BATCHES_STREAM, subject=topology.batch_subject(job))),
        ("spec", lambda js, kv: kv.put(job, b'{"crafted": true}')),
        ("other_spec", lambda js, kv: kv.put(OTHER_JOB, b'{"crafted": true}')),
        ("batch", lambda js, kv: js.publish(topology.batch_subject(OTHER_JOB), planned)),
        ("delete_durable", lambda js, kv: js.delete_consumer(topology.BATCHES_STREAM, topology.gpu_durable(job))),
    ]
    denied, raised = asyncio.run(_try_as(envs["consumer"], operations))
    assert all(raised[name] is not None for name, _ in operations), raised
    text = "\n".join(denied).lower()
    for subject in (
        f"$JS.API.STREAM.PURGE.{topology.BATCHES_STREAM}",
        f"$KV.{topology.JOBS_BUCKET}.{job}",
        f"$KV.{topology.JOBS_BUCKET}.{OTHER_JOB}",
        topology.batch_subject(OTHER_JOB),
        f"$JS.API.CONSUMER.DELETE.{topology.BATCHES_STREAM}.{topology.gpu_durable(job)}",
    ):
        assert f'permissions violation for publish to "{subject.lower()}"' in text, denied
    # Nothing of it happened.
    assert asyncio.run(_state(envs["admin"], job)) == (batches, spec)
    # Other roles publish no batch at all, not even of their own job.
    denied, raised = asyncio.run(
        _try_as(envs["monitor"], [("batch", lambda js, kv: js.publish(topology.batch_subject(job), planned))])
    )
    assert raised["batch"] is not None and topology.batch_subject(job).lower() in "\n".join(denied).lower()


def test_a_worker_with_another_roles_credentials_stops_in_one_line(roles, hsx, tmp_path, tiny_model):
    """An uploader started with the monitor's credentials: its durable's create is refused, and
    it exits 2 with one line naming the subject instead of waiting out an outage."""
    server, envs, _ = roles
    _produce(hsx, envs["producer"], tmp_path, tiny_model, WRONG_ROLE_JOB, rows=4)
    result = hsx(
        "upload",
        *("--job", WRONG_ROLE_JOB, "--spool", str(tmp_path / "spool"), "--node", NODE),
        env=envs["monitor"],
        nats_url=server.url,
        timeout=60,
    )
    line = assert_one_line_error(result, "NATS refused", "permissions violation", "hsx_files", "hsx-monitor")
    assert "nats-config" in line
    assert envs["monitor"]["HSX_NATS_PASSWORD"] not in result.stdout + result.stderr


def test_any_trainer_may_record_an_end_and_the_streams_ranks_refuse_a_forged_one(roles):
    """One trainer user for every stream: the server takes another stream's forged end (its
    end at the 2nd of 8 markers, published after all 8); the stream's ranks refuse it and end
    where the job does."""
    server, envs, log_path = roles
    admin, trainer = _settings(envs["admin"]), _settings(envs["trainer"])
    spec, last = _fake_job(admin, FORGED_JOB, 8)
    forged = _end_record(spec, "victim", end_seq=_marker_sequences(admin, FORGED_JOB)[1], done=True)
    violations_before = len(_violations(log_path))
    _publish_records(trainer, forged)
    assert _records_on(admin, spec, "victim") == [forged]
    indices, end = _Following(trainer, spec, "victim").result()
    assert indices == list(range(8)) and (end.end_seq, end.done) == (last, True), (indices, end)
    assert _violations(log_path)[violations_before:] == []


ROLLUP_NOT_PERMITTED = 10111  # JetStream's error code for a rollup on a stream that allows none


def _matches(pattern: str, subject: str) -> bool:
    """Whether a NATS subject permission (`*` one token, `>` the rest) covers `subject`."""
    tokens, wanted = pattern.split("."), subject.split(".")
    for i, token in enumerate(tokens):
        if token == ">":
            return len(wanted) > i
        if i >= len(wanted) or token not in ("*", wanted[i]):
            return False
    return len(tokens) == len(wanted)


def _job_messages(settings: NatsSettings, job: str) -> dict[str, dict[str, int]]:
    """Stream -> subject -> messages stored, of every subject of `job` in every hsx stream."""

    async def read() -> dict[str, dict[str, int]]:
        nc = await connect(settings, name="test-job-messages")
        try:
            js = nc.jetstream()
            found = {}
            for stream, subject in topology.job_subjects(job).items():
                info = await js.stream_info(stream, subjects_filter=subject)
                found[stream] = dict(info.state.subjects or {})
            return found
        finally:
            await close_connection(nc)

    return asyncio.run(read())


def _store_one_of_each(settings: NatsSettings, spec: JobSpec) -> None:
    """Beside the job's markers, a message on every other kind of subject a role may publish: a
    `written` marker, a re-queue, a heartbeat of each service, the checkpoint, an epoch end, a
    dead letter of each kind, a file event and a batch (nothing consumes this job)."""
    job, plan = spec.job, spec.plan_tag

    async def store() -> None:
        nc = await connect(settings, name="test-one-of-each")
        try:
            js, events = nc.jetstream(), EventPublisher(nc, nc.jetstream(), job)
            written = schemas.BatchWritten(
                job=job,
                batch_id="b0",
                consumer="c",
                node=NODE,
                sample_indices=[0],
                tokens=10,
                bytes=1,
                seconds=0.1,
                plan=plan,
            )
            await events.mark(written, subject=topology.written_subject(job, plan, "b0"))
            await js.publish(topology.event_subject(job, "requeued"), b"{}")
            for service in (topology.CONSUMER_SERVICE, topology.UPLOADER_SERVICE):
                await js.publish(topology.heartbeat_subject(job, service, "probe-1"), b"{}")
            await js.publish(topology.checkpoint_subject(job), b"{}")
            await js.publish(topology.epoch_end_subject(job, plan, "s"), b"{}")
            for what in ("batch", "file"):
                await js.publish(topology.dead_subject(job, what), b"{}")
            await js.publish(topology.file_subject(job, NODE), b"{}")
            await js.publish(topology.batch_subject(job), b"{}")
        finally:
            await close_connection(nc)

    asyncio.run(store())


def _rollups_as(env: dict[str, str], subjects: list[str]) -> dict[tuple[str, str], object]:
    """Publish on each subject with `Nats-Rollup: all` and `sub` as the role's user; per (subject,
    value) the error code the server answered with, or the ack if it stored the message."""

    async def publish() -> dict[tuple[str, str], object]:
        nc = await connect(_settings(env), name="test-rollups")
        try:
            js, answers = nc.jetstream(timeout=5.0), {}
            for subject in subjects:
                for value in ("all", "sub"):
                    try:
                        answers[subject, value] = await js.publish(subject, b"{}", headers={"Nats-Rollup": value})
                    except nats.js.errors.APIError as exc:
                        answers[subject, value] = exc.err_code
            return answers
        finally:
            await close_connection(nc)

    return asyncio.run(publish())


def test_no_role_can_erase_messages_with_a_rollup(roles):
    """Every message subject each role may publish, with that role's own credentials, published
    with `Nats-Rollup: all` and with `sub`: the server refuses every one (no hsx stream allows
    rollups), and every message of the job in every stream is still there. Where a subject holds
    messages of the job (its markers, heartbeats, checkpoint, epoch end, letters, queues) it is
    tried on each; elsewhere on one subject it covers. Not tried: the producer's and admin's
    `$KV.` and `$O.` subjects (the bucket and object store allow rollups for nats-py's own use;
    those two roles may update and purge any stream anyway)."""
    server, envs, log_path = roles
    admin = _settings(envs["admin"])
    spec, _ = _fake_job(admin, ROLLUP_JOB, 8)
    _store_one_of_each(admin, spec)
    before = _job_messages(admin, ROLLUP_JOB)
    stored = [subject for subjects in before.values() for subject in subjects]
    assert len(stored) == 8 + 10, before
    violations_before = len(_violations(log_path))
    tried: set[str] = set()
    for role in permissions.ROLES:
        allowed = permissions.role_permissions(role, user=f"hsx-{role}", jobs=(ROLLUP_JOB,), nodes=(NODE,))
        patterns = [subject for subject in allowed.publish if subject.startswith("hsx.")]
        assert patterns, role
        subjects = []
        for pattern in patterns:
            held = [subject for subject in stored if _matches(pattern, subject)]
            subjects += held or [pattern.replace(">", "probe").replace("*", "probe")]
        answers = _rollups_as(envs[role], subjects)
        assert answers == dict.fromkeys(answers, ROLLUP_NOT_PERMITTED), (role, answers)
        tried.update(subjects)
    assert set(stored) <= tried, set(stored) - tried  # every message was aimed at by some role
    assert _job_messages(admin, ROLLUP_JOB) == before
    assert _violations(log_path)[violations_before:] == []


@pytest.fixture(scope="module")
def stream_roles(tmp_path_factory):
    """A server with a trainer user per stream (`--trainer-stream a --trainer-stream b`)."""
    root = tmp_path_factory.mktemp("stream-roles")
    out = root / "nats-config"
    write_nats_config(NatsConfigConfig(out=out, jobs=(STREAM_JOB,), trainer_streams=("a", "b"), bcrypt_cost=4))
    server = start_nats_server(root / "server", log_file=root / "server.log", extra_args=("-c", str(out / AUTH_FILE)))
    users = [(role, permissions.ANY) for role in permissions.ROLES if role != "trainer"] + [
        ("trainer", "a"),
        ("trainer", "b"),
    ]
    envs = {
        (role if stream == permissions.ANY else f"{role}-{stream}"): {
            **_read_env(out / env_file(role, stream)),
            "HSX_NATS_URL": server.url,
        }
        for role, stream in users
    }
    assert not (out / env_file("trainer")).exists()
    yield server, envs, root / "server.log"
    server.stop()


def test_a_trainer_user_per_stream_may_not_record_another_streams_end(stream_roles):
    """Stream b's trainer forges stream a's end: the server refuses the publish and stores
    nothing (and a rank of stream a run with b's user stops in one line); stream a's ranks end
    where the job does, and stream b records its own end."""
    server, envs, log_path = stream_roles
    admin = _settings(envs["admin"])
    spec, last = _fake_job(admin, STREAM_JOB, 8)
    forged = _end_record(spec, "a", end_seq=_marker_sequences(admin, STREAM_JOB)[1], done=True)
    subject = topology.epoch_end_subject(STREAM_JOB, spec.plan_tag, "a")
    denied, raised = asyncio.run(
        _try_as(envs["trainer-b"], [("forge", lambda js, kv: js.publish(subject, schemas.encode(forged)))])
    )
    assert raised["forge"] is not None and f'permissions violation for publish to "{subject.lower()}"' in (
        "\n".join(denied).lower()
    ), denied
    assert _records_on(admin, spec, "a") == []
    # A rank of stream a run with b's user: its own record is refused too, and it says so.
    with pytest.raises(
        PermissionDenied, match=f'stream a of job {STREAM_JOB}: permissions violation for publish to "{subject}"'
    ):
        _Following(_settings(envs["trainer-b"]), spec, "a").result()
    violations_before = len(_violations(log_path))
    for stream in ("a", "b"):
        indices, end = _Following(_settings(envs[f"trainer-{stream}"]), spec, stream).result()
        assert indices == list(range(8)) and (end.end_seq, end.done) == (last, True), (stream, indices, end)
        assert [record.end_seq for record in _records_on(admin, spec, stream)] == [last]
    assert _violations(log_path)[violations_before:] == []


def test_nats_config_writes_secrets_once_and_never_shows_them(cli, tmp_path):
    out = tmp_path / "nc"
    first = cli("nats-config", "--out", str(out), "--job", "j1", "--bcrypt-cost", "4")
    assert first.returncode == 0, first.stderr
    passwords = {role: _read_env(out / env_file(role))["HSX_NATS_PASSWORD"] for role in permissions.ROLES}
    assert len(set(passwords.values())) == len(permissions.ROLES)
    conf = (out / AUTH_FILE).read_text()
    for role, password in passwords.items():
        assert password not in first.stdout + first.stderr + conf
        assert f'user: "hsx-{role}"' in conf
        assert stat.S_IMODE(os.stat(out / env_file(role)).st_mode) == 0o600
    again = cli("nats-config", "--out", str(out))
    assert again.returncode == 2 and "--force" in again.stderr
    assert _read_env(out / env_file("consumer"))["HSX_NATS_PASSWORD"] == passwords["consumer"]
    updated = cli("nats-config", "--out", str(out), "--update", "--job", "j1", "--job", "j2", "--bcrypt-cost", "4")
    assert updated.returncode == 0, updated.stderr
    assert _read_env(out / env_file("consumer"))["HSX_NATS_PASSWORD"] == passwords["consumer"]
    assert '"hsx.batches.j2"' in (out / AUTH_FILE).read_text() and '"hsx.batches.j2"' not in conf
    forced = cli("nats-config", "--out", str(out), "--force", "--bcrypt-cost", "4")
    assert (
        forced.returncode == 0 and _read_env(out / env_file("consumer"))["HSX_NATS_PASSWORD"] != passwords["consumer"]
    )


def test_nats_config_makes_a_trainer_user_per_stream(cli, tmp_path):
    """--trainer-stream: `hsx-trainer-<name>` per stream, in place of `hsx-trainer`, each allowed
    its own stream's epoch end only; --update keeps their passwords and gives a new stream its first."""
    out = tmp_path / "nc"
    first = cli("nats-config", "--out", str(out), "--job", "j1", "--trainer-stream", "a", "--trainer-stream", "b-2")
    assert first.returncode == 0, first.stderr
    assert "hsx-trainer-a" in first.stdout and "hsx-trainer," not in first.stdout
    assert not (out / env_file("trainer")).exists()
    conf = (out / AUTH_FILE).read_text()
    assert 'user: "hsx-trainer"' not in conf
    for stream in ("a", "b-2"):
        env = _read_env(out / env_file("trainer", stream))
        assert env["HSX_NATS_USER"] == f"hsx-trainer-{stream}"
        assert env["HSX_NATS_INBOX_PREFIX"] == f"_INBOX.hsx-trainer-{stream}"
        allowed = permissions.role_permissions("trainer", user=env["HSX_NATS_USER"], jobs=("j1",), stream=stream)
        assert [p for p in allowed.publish if ".epoch." in p] == [f"hsx.events.j1.epoch.*.{stream}"]
        assert f'"hsx.events.j1.epoch.*.{stream}"' in conf
    # The admin keeps every stream's (it runs every role); no trainer user has every stream's.
    assert conf.count('"hsx.events.j1.epoch.>"') == 1
    password = _read_env(out / env_file("trainer", "a"))["HSX_NATS_PASSWORD"]
    updated = cli("nats-config", "--out", str(out), "--update", "--trainer-stream", "a", "--trainer-stream", "c")
    assert updated.returncode == 0, updated.stderr
    assert _read_env(out / env_file("trainer", "a"))["HSX_NATS_PASSWORD"] == password
    assert _read_env(out / env_file("trainer", "c"))["HSX_NATS_PASSWORD"] not in (password, "")
    bad = cli("nats-config", "--out", str(tmp_path / "bad"), "--trainer-stream", "a.b")
    assert_one_line_error(bad, "--trainer-stream", "a.b")


@pytest.mark.parametrize("jobs,nodes", [((permissions.ANY,), (permissions.ANY,)), (("j1", "j-2"), ("n1",))])
def test_every_permission_is_a_subject_nats_server_matches(jobs, nodes):
    """Wildcards only as whole tokens (`gpu-*` would match nothing), `>` only last, and no role
    but the admin may purge, delete a durable it does not own, or write the jobs bucket."""
    users = [(role, permissions.ANY) for role in permissions.ROLES] + [("trainer", "s-1")]
    for role, stream in users:
        allowed = permissions.role_permissions(role, user=f"hsx-{role}", jobs=jobs, nodes=nodes, stream=stream)
        for subject in allowed.publish + allowed.subscribe:
            tokens = subject.split(".")
            assert all(token in ("*", ">") or not {"*", ">"} & set(token) for token in tokens), subject
            assert ">" not in tokens[:-1], subject
        purges = {subject for subject in allowed.publish if ".STREAM.PURGE." in subject}
        if role == "producer":  # storing an object again drops its old chunks; no other purge
            assert purges == {f"$JS.API.STREAM.PURGE.{topology.object_store_stream(topology.DATASETS_BUCKET)}"}
        elif role != "admin":
            assert purges == set(), role
        if role not in ("admin", "producer"):
            assert not [subject for subject in allowed.publish if subject.startswith("$KV.")], role
            assert not [subject for subject in allowed.publish if ".STREAM.CREATE." in subject], role
    with pytest.raises(HsxError):
        permissions.role_permissions("consumer", user="u", jobs=("a.b",))
    with pytest.raises(HsxError):
        permissions.role_permissions("trainer", user="u", stream="a.b")
