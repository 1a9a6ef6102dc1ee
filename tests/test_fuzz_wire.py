"""Fuzzing every wire message and the KV entry at the boundary where hsx decodes it.

Each test starts from real messages, built as the services build them (hsx's constructors,
`build_letters`, `write_sample_file`), mutates them (tests/fuzzing.py) and feeds the bytes to the
real decoder and then to the checks that act on what decoded, in the order the services run
them (docs/reliability/index.md, "Trust: who may publish what, and what is checked where").
The property, for every case: the decoder refuses with its own error (msgspec.DecodeError, or
HsxError for the spec), never another exception (a traceback in a service); a check given a
decoded but hostile value refuses it or passes only what the plan names; nothing is written or
removed outside the job's own spool and destination folders, and no stored sample changes.
"""

import asyncio
import hashlib
import os
import shutil
from pathlib import Path

import msgspec
import nats
import pytest
import torch
from fuzzing import FUZZ, HOSTILE_TEXT, Cases, dumps, mutated, nested_unknown_field
from hypothesis import example, given
from hypothesis import strategies as st

from hsx.commands.dead import _describe, _payload_batch_id, _target
from hsx.errors import HsxError
from hsx.gpu_consumer.plansamples import PlanSamples, PlanSamplesUnavailable, batch_placed
from hsx.gpu_consumer.writer import write_sample_file
from hsx.job import JobSpec, plan_batch_id, plan_tag_of
from hsx.monitor import report
from hsx.storage.destinations.file import FileDestination
from hsx.storage.expected import ExpectedSamples
from hsx.storage.layout import SampleFiles, sample_key
from hsx.storage.location import spec_location
from hsx.storage.sampledigest import sample_digest
from hsx.storage.spool import batch_bytes, plan_folder, remove_stale_plans, spool_file
from hsx.uploader.config import UploaderConfig
from hsx.uploader.service import FileMover, _OutdatedEvent, _PermanentFailure, _SpoolFileLost
from hsx.wire import schemas, statusview, topology
from hsx.wire.deadletter import build_letters
from hsx.wire.events import HEARTBEAT_CLOCK_SKEW_S, EventPublisher, heard_heartbeat, read_marker
from hsx.wire.exhausted import advisory_of
from hsx.wire.fold import ProgressFold, _letter_of_plan, checkpoint_of, ends_at_markers
from hsx.wire.jobs import decode_job_spec
from hsx.wire.natsconn import NatsSettings
from hsx.wire.spec_changes import refused_change

NODE = "node-1"
INSTANCE = f"{NODE}-host-4242"
FINGERPRINT = hashlib.sha256(b"the fuzzed plan").hexdigest()
PLAN = plan_tag_of(FINGERPRINT)
OTHER_PLAN = "0123456789ab"
SAMPLES = [
    schemas.Sample(
        index=i,
        source_id=f"row-{i}",
        input_ids=[(7 * i + k) % 500 for k in range(3 + i % 3)],
        loss_spans=[(1, 3 + i % 3)],
    )
    for i in range(6)
]
# The oldest form of a mask (one 0/1 per token) still decodes: one sample carries it.
SAMPLES[5] = schemas.Sample(index=5, source_id="row-5", input_ids=[3, 1, 4, 1, 5], loss_mask=[0, 1, 1, 0, 1])


def _spec(job: str, dest: str) -> JobSpec:
    return JobSpec(
        job=job,
        model="tiny/qwen3",
        model_revision="main",
        layers=[1, 3],
        dtype="bfloat16",
        dest=dest,
        token_budget=64,
        max_seq_len=16,
        dataset="rows.jsonl",
        plan_fingerprint=FINGERPRINT,
        total_samples=len(SAMPLES),
        total_tokens=sum(len(s.input_ids) for s in SAMPLES),
        total_batches=3,
        created_at=1765000000.25,
        published=True,
        tokenized_object=f"{job}.tokens.arrow",
        report_object=f"{job}.report.json",
        num_layers=4,
        hidden_size=4,
        sample_digests=True,
    )


def _batches(job: str) -> list[schemas.BatchDescriptor]:
    return [
        schemas.BatchDescriptor(
            job=job,
            batch_id=plan_batch_id(job, FINGERPRINT, seq),
            padded_len=max(len(s.input_ids) for s in SAMPLES[2 * seq : 2 * seq + 2]),
            samples=SAMPLES[2 * seq : 2 * seq + 2],
            plan=PLAN,
        )
        for seq in range(3)
    ]


def _tree(message: schemas._Wire) -> object:
    return msgspec.to_builtins(message)


def _only(errors: tuple[type[BaseException], ...], call, *args, **kwargs):
    """`call`'s result, or None when it raised one of `errors` (any other exception fails the test)."""
    try:
        return call(*args, **kwargs)
    except errors:
        return None


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _descriptor_outcome(data: bytes, spec: JobSpec, plan_samples: PlanSamples, loop) -> tuple[str, object]:
    """A descriptor through the consumer's checks, in their order (gpu_consumer/service.py
    `_compute_batch`, `_in_plan`)."""
    try:
        batch = schemas.batch_decoder.decode(data)
    except msgspec.DecodeError:
        return "poison", None
    if not spec.owns(batch.plan):
        return "another plan's", batch
    if batch.job != spec.job or not batch_placed(spec, batch):
        return "refused", batch
    try:
        refused = loop.run_until_complete(plan_samples.refused(batch))
    except PlanSamplesUnavailable:
        return "waits", batch
    return ("refused" if refused else "extracted"), batch


@st.composite
def forged_descriptor(draw, job: str) -> bytes:
    """A descriptor that decodes, of the job and its plan, as anyone who can publish on the job's
    subject could make one: planned samples, some of them changed (a token, the mask, the source
    id, the index: another planned one or one past the plan), under a batch id of the plan's or of
    another form."""
    samples = []
    for planned in draw(st.lists(st.sampled_from(SAMPLES), min_size=1, max_size=3, unique_by=lambda s: s.index)):
        sample = msgspec.to_builtins(planned)
        change = draw(st.sampled_from(["none", "token", "mask", "source_id", "index"]))
        if change == "token":
            at = draw(st.integers(0, len(sample["input_ids"]) - 1))
            sample["input_ids"][at] = draw(st.integers(0, (1 << 31) - 1))
        elif change == "mask":
            sample.pop("loss_spans", None)
            sample["loss_mask"] = draw(
                st.lists(st.integers(0, 1), min_size=len(sample["input_ids"]), max_size=len(sample["input_ids"]))
            )
        elif change == "source_id":
            sample["source_id"] = draw(HOSTILE_TEXT)
        elif change == "index":
            sample["index"] = draw(st.one_of(st.integers(0, len(SAMPLES) + 2), st.integers(0, (1 << 63) - 1)))
        samples.append(sample)
    if len({sample["index"] for sample in samples}) < len(samples):
        samples = samples[:1]
    batch_id = draw(
        st.one_of(
            st.builds(lambda seq: plan_batch_id(job, FINGERPRINT, seq), st.integers(0, 5)),
            st.just(f"{job}-redo-2-77"),
        )
    )
    batch = {
        "type": "batch.v1",
        "job": job,
        "batch_id": batch_id,
        "padded_len": max(len(sample["input_ids"]) for sample in samples),
        "samples": samples,
        "plan": PLAN,
    }
    return dumps(batch)


@pytest.mark.parametrize("focus", [(), ("samples", 0)], ids=["BatchDescriptor", "Sample"])
def test_a_fuzzed_descriptor_is_refused_or_is_exactly_the_planned_samples(
    focus, nats_server, job_name, loop, record_property
):
    spec = _spec(job_name, "file:///srv/out")
    cases = Cases()
    kind = "Sample" if focus else "BatchDescriptor"

    async def setup():
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        store = await topology.ensure_datasets_store(js)
        await store.put(topology.digests_object_name(job_name), b"".join(sample_digest(s) for s in SAMPLES))
        return nc, js

    nc, js = loop.run_until_complete(setup())
    plan_samples = PlanSamples(js, lambda: spec)
    bases = [_tree(batch) for batch in _batches(job_name)]
    planned = {s.index: (s.input_ids, s.mask(), s.source_id) for s in SAMPLES}
    outcomes: dict[str, int] = {}

    @FUZZ
    @given(
        st.one_of(st.sampled_from(bases).flatmap(lambda base: mutated(base, focus=focus)), forged_descriptor(job_name))
    )
    # Found: an unknown field nested 1000 deep raised RecursionError out of every decoder.
    @example(nested_unknown_field(dumps(bases[0])))
    def check(data: bytes) -> None:
        cases(kind)
        outcome, batch = _descriptor_outcome(data, spec, plan_samples, loop)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        # Every sample the digests name is planned: a placed batch never waits for its round.
        assert outcome != "waits", batch
        if outcome == "extracted":
            for sample in batch.samples:
                assert (sample.input_ids, sample.mask(), sample.source_id) == planned[sample.index], sample

    try:
        check()
    finally:
        loop.run_until_complete(nc.close())
    cases.record(record_property)
    # The fuzzing reached both sides of the check, not only the decoder's refusals.
    assert outcomes.get("extracted") and outcomes.get("refused") and outcomes.get("poison"), outcomes


# --- file-ready events, through the uploader's own moves on a real spool and destination ---


def _snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """Every entry under `root`: relative path -> (kind, content digest or link target)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = ("dir", "")
            else:
                found[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def test_a_fuzzed_file_event_moves_nothing_but_its_own_plans_files(tmp_path, job_name, record_property):
    """`FileMover._move` is called for every event that decodes, also those the plan check
    before it would refuse: the paths it touches are derived from (job, plan, index) alone."""
    work, template = tmp_path / "work", tmp_path / "template"
    spool, dest = template / "spool", template / "dest"
    spec = _spec(job_name, (work / "dest").as_uri())
    torch.manual_seed(0)
    events = {}
    for sample in SAMPLES[:5]:
        states = torch.randn(len(sample.input_ids), 2, 4).to(torch.bfloat16)
        events[sample.index] = write_sample_file(
            spool=spool, files=SampleFiles.of(spec), node=NODE, batch_id="b", sample=sample, hidden_states=states
        )
    # Samples 0 and 1 are stored; 2 and 3 wait in the spool; 4's file lies outside the spool, and
    # its spool path is a link planted to it; 5 is nowhere.
    for index in (0, 1):
        (dest / sample_key(job_name, index)).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(spool_file(spool, job_name, PLAN, index), dest / sample_key(job_name, index))
    (template / "outside").mkdir()
    shutil.move(spool_file(spool, job_name, PLAN, 4), template / "outside" / "victim.safetensors")
    # spool/<job>/<plan>/00000/4.safetensors -> outside/victim.safetensors
    os.symlink("../../../../outside/victim.safetensors", spool_file(spool, job_name, PLAN, 4))
    for other in (spool / job_name / OTHER_PLAN / "00000", spool / "other-job" / PLAN / "00000", dest / "other-job"):
        other.mkdir(parents=True)
        shutil.copy(dest / sample_key(job_name, 1), other / "1.safetensors")
    spooled = {i: spool_file(spool, job_name, PLAN, i).read_bytes() for i in (2, 3)}
    before = _snapshot(template)
    own_spool = f"spool/{job_name}/{PLAN}/"
    own_dest = f"dest/{job_name}/"

    shutil.copytree(template, work, symlinks=True)
    cfg = UploaderConfig(nats=NatsSettings(), instance=INSTANCE, job=job_name, spool=work / "spool", node=NODE)
    mover = FileMover(cfg, FileDestination(work / "dest"), EventPublisher(None, None, job_name), spec)
    bases = [_tree(events[i]) for i in range(5)]
    cases = Cases()

    def unchanged_but_the_plans_own(ready: schemas.FileReady) -> None:
        after = _snapshot(work)
        for rel in before.keys() | after.keys():
            was, now = before.get(rel), after.get(rel)
            if was == now:
                continue
            if now is None:  # removed: only the plan's own spool files (uploaded, found stored, corrupt)
                assert rel.startswith(own_spool) and was[0] != "dir", f"{rel} removed for {ready}"
            elif was is None:  # added: a folder of the job's, or a spooled file moved to its own key
                moved = [i for i in spooled if rel == f"dest/{sample_key(job_name, i)}"]
                assert (rel.startswith(own_dest) and now[0] == "dir") or (
                    moved and now == ("file", hashlib.sha256(spooled[moved[0]]).hexdigest())
                ), f"{rel} added for {ready}"
            else:
                raise AssertionError(f"{rel} changed for {ready}")

    @FUZZ
    @given(st.sampled_from(bases).flatmap(mutated))
    @example(nested_unknown_field(dumps(bases[2])))
    # Found: the file's own digest with another size moved it into place, then failed the move's
    # check as a destination error (retried, then sent back for extraction); now refused first.
    @example(dumps({**bases[2], "size": bases[2]["size"] + 1}))
    @example(dumps(bases[4]))  # the planted link: refused, its target untouched
    def check(data: bytes) -> None:
        cases("FileReady")
        shutil.rmtree(work)
        shutil.copytree(template, work, symlinks=True)
        ready = _only((msgspec.DecodeError,), schemas.file_decoder.decode, data)
        if ready is None:
            return
        _only((_PermanentFailure, _SpoolFileLost, _OutdatedEvent), mover._move, ready)
        unchanged_but_the_plans_own(ready)

    try:
        check()
    finally:
        mover.close()
    cases.record(record_property)


# --- the job spec, as every reader of the KV entry decodes it ---


SPEC_FINDS = [
    # urlsplit raised ValueError ("Invalid IPv6 URL") out of decode_job_spec.
    {"dest": "s3://[x/y"},
    {"dest": "file://[::1/x"},
    # A percent-encoded `..` or NUL passed as a canonical local path.
    {"dest": "file:///srv/%2E%2E/etc"},
    {"dest": "file:///srv/a%00b"},
    # An integer past int64 decoded as a count (readers size int64 arrays by the counts).
    {"total_samples": 2**70},
]


def test_a_fuzzed_job_spec_is_refused_in_one_line_or_names_only_its_own_paths(tmp_path, job_name, record_property):
    held = _spec(job_name, "file:///srv/out")
    base = _tree(held)
    spool = tmp_path / "spool"
    for folder in (spool / job_name / PLAN, spool / job_name / OTHER_PLAN, spool / "other-job" / OTHER_PLAN):
        folder.mkdir(parents=True)
        (folder / "1.safetensors").write_bytes(b"sentinel")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_bytes(b"sentinel")
    before = _snapshot(tmp_path)
    cases = Cases()

    def check_one(data: bytes) -> None:
        cases("JobSpec (KV entry)")
        spec = _only((HsxError,), decode_job_spec, data, job=job_name)
        if spec is None:
            return
        assert spec.job == job_name
        numbers = [getattr(spec, name) for name in spec.__struct_fields__ if type(getattr(spec, name)) is int]
        assert all(0 <= n < 2**63 for n in numbers + spec.round_starts), spec
        location = _only((HsxError,), spec_location, spec.dest)
        if location is not None and location.local_folder is not None:
            path = Path(location.path)
            assert path.is_absolute() and ".." not in path.parts and "\x00" not in location.path, location
        assert plan_folder(spool, spec.job, spec.plan_tag).parent == spool / job_name
        _only((HsxError,), ExpectedSamples.of_spec, spec, where="fuzz")
        files = _only((HsxError,), SampleFiles.of, spec)
        if files is not None:
            batch_bytes(files)
        spec.is_plan_batch(plan_batch_id(job_name, FINGERPRINT, 1))
        change = refused_change(held, spec)
        if change is None:  # adopted: nothing a worker checks moved
            assert (spec.dest, spec.layers, spec.dtype, spec.sample_digests) == (
                held.dest,
                held.layers,
                held.dtype,
                held.sample_digests,
            )
            assert spec.total_samples >= held.total_samples and spec.published
        # A worker starting on the spec clears what earlier plans of its name left: only there.
        remove_stale_plans(spool, spec)
        after = _snapshot(tmp_path)
        for rel in before.keys() | after.keys():
            if before.get(rel) != after.get(rel):
                assert rel.startswith(f"spool/{job_name}/") and rel not in after, rel
        shutil.rmtree(spool / job_name)
        for folder in (spool / job_name / PLAN, spool / job_name / OTHER_PLAN):
            folder.mkdir(parents=True)
            (folder / "1.safetensors").write_bytes(b"sentinel")

    @FUZZ
    @given(mutated(base))
    @example(nested_unknown_field(dumps(base)))
    def check(data: bytes) -> None:
        check_one(data)

    for find in SPEC_FINDS:
        check = example(dumps({**base, **find}))(check)
    check()
    cases.record(record_property)


# --- progress markers, as every reader of sums, the index and JobStream reads them ---


def _subject_variants(subject: str) -> st.SearchStrategy[str]:
    tokens = subject.split(".")
    return st.one_of(
        st.just(subject),
        st.builds(
            lambda at, text: ".".join(tokens[:at] + [text] + tokens[at + 1 :]),
            st.integers(0, len(tokens) - 1),
            HOSTILE_TEXT,
        ),
        st.builds(lambda n: ".".join(tokens[:n]), st.integers(0, len(tokens) - 1)),
        st.builds(lambda extra: f"{subject}.{extra}", HOSTILE_TEXT),
    )


@pytest.mark.parametrize("kind", ["BatchWritten", "FileUploaded"])
def test_a_fuzzed_marker_is_read_only_as_what_its_subject_names(kind, job_name, record_property):
    written = schemas.BatchWritten(
        job=job_name,
        batch_id=plan_batch_id(job_name, FINGERPRINT, 1),
        consumer=INSTANCE,
        node=NODE,
        sample_indices=[2, 3],
        tokens=9,
        bytes=4096,
        seconds=0.25,
        plan=PLAN,
    )
    uploaded = schemas.FileUploaded(
        job=job_name,
        node=NODE,
        uploader=INSTANCE,
        sample_index=3,
        key=sample_key(job_name, 3),
        size=2048,
        tokens=4,
        plan=PLAN,
        digest="ab" * 32,
        sample_digest="cd" * 16,
    )
    bases = [
        ("BatchWritten", _tree(written), topology.written_subject(job_name, PLAN, written.batch_id)),
        ("FileUploaded", _tree(uploaded), topology.uploaded_subject(job_name, PLAN, 3)),
        ("FileUploaded", _tree(uploaded), topology.uploaded_subject(job_name, PLAN, 3, planned=False)),
        (
            "FileUploaded",
            _tree(msgspec.structs.replace(uploaded, replaces=True)),
            topology.replaced_subject(job_name, PLAN, 3),
        ),
    ]
    cases = Cases()
    first = next(base for base in bases if base[0] == kind)

    @FUZZ
    @given(
        st.sampled_from([base for base in bases if base[0] == kind]).flatmap(
            lambda b: st.tuples(mutated(b[1]), _subject_variants(b[2]))
        )
    )
    @example((nested_unknown_field(dumps(first[1])), first[2]))
    # Found: a size past int64 was taken, and `hsx index` stored it in an int64 array (OverflowError).
    @example((dumps({**first[1], "size" if kind == "FileUploaded" else "bytes": 2**64}), first[2]))
    def check(case) -> None:
        data, subject = case
        cases(kind)
        event = read_marker(data, subject=subject, job=job_name)
        if event is None:
            return
        tokens = subject.split(".")
        assert tokens[2] == job_name and event.job == job_name and event.plan in ("", tokens[4])
        named = event.batch_id if isinstance(event, schemas.BatchWritten) else str(event.sample_index)
        assert tokens[-1] == named
        # What the index and the sums store of a marker fits their int64 columns.
        numbers = [getattr(event, name) for name in event.__struct_fields__ if type(getattr(event, name)) is int]
        assert all(0 <= n < 2**63 for n in numbers + getattr(event, "sample_indices", [])), event
        fold = ProgressFold(job=job_name, plan=PLAN)
        fold.apply_marker(event, seq=7, planned=len(tokens) > 5 and tokens[5] != topology.EXTRA)
        fold.checkpoint()

    check()
    cases.record(record_property)


# --- heartbeats (with a consumer's kernels), as the monitor, status and `jobs delete` hear them ---


@pytest.mark.parametrize("focus", [(), ("kernels",)], ids=["Heartbeat", "Kernels"])
def test_a_fuzzed_heartbeat_is_heard_only_as_its_own_workers_within_the_clock_skew(focus, job_name, record_property):
    beat = schemas.Heartbeat(
        job=job_name,
        service="gpu_consumer",
        instance=INSTANCE,
        node=NODE,
        state="working",
        detail="",
        sent_at=1765000100.5,
        last_batch=plan_batch_id(job_name, FINGERPRINT, 0),
        spool_files=3,
        spool_bytes=12288,
        spool="/var/spool/hsx",
        kernels=schemas.Kernels(attention="sdpa", linear_attention="fla", conv1d="causal_conv1d", compiled=True),
    )
    subject = topology.heartbeat_subject(job_name, beat.service, INSTANCE)
    stored_at = beat.sent_at + 0.5
    kind = "Kernels" if focus else "Heartbeat"
    cases = Cases()

    @FUZZ
    @given(mutated(_tree(beat), focus=focus), _subject_variants(subject) if not focus else st.just(subject))
    @example(nested_unknown_field(dumps(_tree(beat))), subject)
    def check(data: bytes, heard_on: str) -> None:
        cases(kind)
        heard = heard_heartbeat(data, subject=heard_on, stored_at=stored_at, job=job_name)
        if heard is None:
            return
        assert heard.job == job_name and heard_on == topology.heartbeat_subject(job_name, heard.service, heard.instance)
        assert abs(heard.sent_at - stored_at) <= HEARTBEAT_CLOCK_SKEW_S
        fold = ProgressFold(job=job_name, plan=PLAN)
        fold.apply(heard)
        # What the monitor and `hsx status` make of the beats they heard.
        beats, now = fold.heartbeats, stored_at + 10
        for view in (report.worker_states, report.silent_workers, report.degraded_workers, report.stalled_workers):
            view(beats, now=now, silent_after_s=30.0)
        report.spool_by_node(beats)
        for view in (
            statusview.destination_refusals,
            statusview.workers_alive,
            statusview.live_consumers,
            statusview.destination_trouble,
        ):
            view(beats, now=now, live_s=30.0)

    check()
    cases.record(record_property)


# --- dead letters, as `hsx dead retry` sends them back and the sums fold them ---


def test_a_fuzzed_dead_letter_is_sent_back_only_to_its_jobs_own_subjects(job_name, record_property):
    spec = _spec(job_name, "file:///srv/out")
    batch = _batches(job_name)[1]
    ready = schemas.FileReady(
        job=job_name,
        node=NODE,
        batch_id=batch.batch_id,
        sample_index=2,
        num_tokens=len(SAMPLES[2].input_ids),
        spool_path=f"{job_name}/{PLAN}/00000/2.safetensors",
        key=sample_key(job_name, 2),
        size=2048,
        digest="ab" * 32,
        plan=PLAN,
        sample_digest=sample_digest(SAMPLES[2]).hex(),
    )
    letters = [
        *build_letters(
            job=job_name,
            what="batch",
            error="sample 2: boom",
            subject=topology.batch_subject(job_name),
            payload=schemas.encode(batch),
            deliveries=5,
            max_payload=1 << 20,
            source_seq=11,
        ),
        *build_letters(
            job=job_name,
            what="file",
            error="spool file lost",
            subject=topology.file_subject(job_name, NODE),
            payload=schemas.encode(ready),
            deliveries=1,
            max_payload=1 << 20,
            source_seq=12,
        ),
        *build_letters(
            job=job_name,
            what="batch",
            error="descriptor does not decode",
            subject=topology.batch_subject(job_name),
            payload=schemas.encode(batch)[:-9],
            deliveries=1,
            max_payload=1 << 20,
            source_seq=13,
        ),
    ]
    bases = [msgspec.json.decode(stored.payload) for stored in letters]
    cases = Cases()

    @FUZZ
    @given(st.sampled_from(bases).flatmap(mutated))
    @example(nested_unknown_field(dumps(bases[0])))
    def check(data: bytes) -> None:
        cases("DeadLetter")
        letter = _only((msgspec.DecodeError,), schemas.dead_decoder.decode, data)
        if letter is None:
            return
        target, payload, why = _target(letter, job_name, spec)
        _describe(1, letter, "", why)
        _payload_batch_id(letter)
        _letter_of_plan(letter, PLAN)
        ProgressFold(job=job_name, plan=PLAN).apply(letter)
        if not target:
            assert why and "\n" not in why and not payload
            return
        decoder = schemas.batch_decoder if letter.what == "batch" else schemas.file_decoder
        message = decoder.decode(payload)
        assert message.job == job_name and spec.owns(message.plan)
        if letter.what == "batch":
            assert target == topology.batch_subject(job_name)
        else:
            assert target == topology.file_subject(job_name, message.node)
            assert target.split(".")[:3] == ["hsx", "files", job_name] and len(target.split(".")) == 4

    check()
    cases.record(record_property)


# --- the progress checkpoint, as every reader of the sums loads it ---


def test_a_fuzzed_checkpoint_is_taken_only_as_its_own_jobs_and_plans(job_name, record_property):
    fold = ProgressFold(job=job_name, plan=PLAN)
    fold.apply_marker(
        schemas.BatchWritten(
            job=job_name,
            batch_id="b",
            consumer=INSTANCE,
            node=NODE,
            sample_indices=[0, 1],
            tokens=7,
            bytes=1024,
            seconds=0.1,
            plan=PLAN,
        ),
        seq=40,
        planned=True,
    )
    base = _tree(fold.checkpoint())
    # HSX_EVENTS as the reader finds it: the one `written` marker the fold summed, at sequence 40.
    stored = {40: topology.written_subject(job_name, PLAN, "b")}
    seq = 41  # the next marker's sequence
    cases = Cases()

    def check_one(data: bytes) -> None:
        cases("ProgressCheckpoint")
        checkpoint = checkpoint_of(data, job=job_name, plan=PLAN)
        if checkpoint is None or not ends_at_markers(checkpoint, stored):
            return
        assert (checkpoint.job, checkpoint.plan) == (job_name, PLAN)
        assert checkpoint.written_seq in (0, 40) and checkpoint.uploaded_seq == 0
        resumed = ProgressFold.from_checkpoint(checkpoint)
        resumed.apply_marker(
            schemas.FileUploaded(
                job=job_name, node=NODE, uploader=INSTANCE, sample_index=0, key="k", size=1, tokens=1, plan=PLAN
            ),
            seq=seq,
            planned=True,
        )
        assert resumed.uploaded_seq == seq
        resumed.checkpoint()

    @FUZZ
    @given(mutated(base))
    @example(nested_unknown_field(dumps(base)))
    # Found: a checkpoint naming another job was taken, and saved again under that job's subject;
    # one reaching past the markers froze the sums.
    @example(dumps({**base, "job": "other-job"}))
    @example(dumps({**base, "written_seq": 2**62}))
    def check(data: bytes) -> None:
        check_one(data)

    check()
    cases.record(record_property)


# --- what is decoded only (its readers are checked elsewhere), and the server's advisory ---


def test_fuzzed_epoch_ends_requeued_events_and_advisories_decode_or_are_refused(job_name, record_property):
    epoch = schemas.EpochEndRecord(
        job=job_name,
        plan=PLAN,
        stream="trainer",
        created_at=1765000000.25,
        end_seq=77,
        done=False,
        total_samples=6,
        reason="2 samples dead-lettered",
        missing=[4, 5],
        missing_count=2,
    )
    requeued = schemas.SampleRequeued(job=job_name, node=NODE, sample_index=4, reason="spool file is corrupt")
    advisory = {
        "type": "io.nats.jetstream.advisory.v1.max_deliver",
        "id": "a5Xv2QpT3kLmNoP1qRsT7u",
        "timestamp": "2026-12-05T10:00:00.000000000Z",
        "stream": topology.BATCHES_STREAM,
        "consumer": topology.gpu_durable(job_name),
        "stream_seq": 5,
        "deliveries": topology.BATCH_MAX_DELIVER,
    }
    cases = Cases()

    @FUZZ
    @given(mutated(_tree(epoch)))
    @example(nested_unknown_field(dumps(_tree(epoch))))
    def epoch_ends(data: bytes) -> None:
        cases("EpochEndRecord")
        _only((msgspec.DecodeError,), schemas.epoch_end_decoder.decode, data)

    @FUZZ
    @given(mutated(_tree(requeued)))
    @example(nested_unknown_field(dumps(_tree(requeued))))
    def requeued_events(data: bytes) -> None:
        cases("SampleRequeued")
        event = _only((msgspec.DecodeError,), schemas.event_decoder.decode, data)
        assert event is None or isinstance(event, schemas.Event.__args__)

    @FUZZ
    @given(mutated(advisory))
    # Found: a sequence of 1e999 (OverflowError) and nesting past the recursion limit escaped.
    @example(dumps({**advisory, "stream_seq": 10**400}).replace(b"1" + b"0" * 400, b"1e999"))
    @example(nested_unknown_field(dumps(advisory)))
    def advisories(data: bytes) -> None:
        cases("MAX_DELIVERIES advisory")
        read = advisory_of(data)
        assert read is None or (read[0] >= 1 and read[1] >= 0)

    epoch_ends()
    requeued_events()
    advisories()
    cases.record(record_property)
