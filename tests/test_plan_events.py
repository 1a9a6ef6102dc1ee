"""`done` means every planned sample is in the destination, exactly
(docs/reliability/faults-crafted.md: stray events).

Progress markers carry their plan in their subject (the job spec's plan tag): an `uploaded`
marker of another plan under the same job name, or of a sample index outside the plan (set aside
under `<plan>.extra.` by the uploader), is never counted, so it cannot stand in for a planned
sample that is missing. Before, `done` was `uploaded >= total`, and a dozen stray events, or a
descriptor published by hand with extra samples, made a job with a missing sample `done`.
Markers are published here as raw JSON with nats-py on the subjects hsx's own publishers use.

A descriptor published by hand with samples past the plan's end is refused by the consumer
(`batch_refused`: removed from the queue, never extracted, never dead-lettered), so it writes no
file and no marker at all, inside or outside the plan.
"""

import asyncio
import json
import time
from pathlib import Path

import msgspec
import nats
import nats.js.errors
import pytest
from test_e2e_s3 import check_ok, logs_of, produce, start_monitor, status, wait_until_done, write_dataset

from hsx.wire import topology

SAMPLES = 6


def _produce(hsx, tmp_path: Path, job: str, model: Path) -> Path:
    # Equal lengths and a budget of two samples per batch: three planned batches of two samples.
    write_dataset(tmp_path / "data.jsonl", SAMPLES, min_len=8, max_len=8, seed=7)
    out = tmp_path / "out"
    produce(
        hsx,
        job=job,
        model=model,
        dataset=tmp_path / "data.jsonl",
        dest=str(out),
        token_budget=16,
        max_seq_len=16,
        env=None,
    )
    return out


async def _plan_tag(js, job: str) -> str:
    entry = await (await js.key_value(topology.JOBS_BUCKET)).get(job)
    return json.loads(entry.value)["plan_fingerprint"][:12]


def _uploaded(job: str, index: int, plan: str) -> bytes:
    return msgspec.json.encode(
        {
            "type": "uploaded.v1",
            "job": job,
            "node": "stray",
            "uploader": "stray",
            "sample_index": index,
            "key": f"{job}/00000/{index}.safetensors",
            "size": 100,
            "tokens": 8,
            "plan": plan,
        }
    )


async def _events(js, subject: str) -> list[dict]:
    """Every message stored under `subject` (a filter) in HSX_EVENTS, in order."""
    found, seq = [], 0
    while True:
        try:
            msg = await js.get_msg(topology.EVENTS_STREAM, seq=seq + 1, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return found
        found.append(json.loads(msg.data))
        seq = msg.seq


def test_stray_events_of_another_plan_or_outside_the_plan_never_make_a_job_done(
    hsx, nats_server, tiny_model, job_name, tmp_path
):
    _produce(hsx, tmp_path, job_name, tiny_model("qwen3"))

    async def mark(js, plan: str, index: int, *, planned: bool = True) -> None:
        await js.publish(
            topology.uploaded_subject(job_name, plan, index, planned=planned),
            _uploaded(job_name, index, plan),
            headers=topology.ONCE_HEADERS,
        )

    async def setup() -> str:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        plan = await _plan_tag(js, job_name)
        # Nothing left queued: only the markers decide.
        await js.purge_stream(topology.BATCHES_STREAM, subject=topology.batch_subject(job_name))
        for index in range(SAMPLES):  # a former job of this name, with another plan, uploaded everything
            await mark(js, "0123456789ab", index)
        for index in range(SAMPLES, 2 * SAMPLES):  # indices past the plan's end
            await mark(js, plan, index, planned=False)
        for index in range(SAMPLES - 1):  # this plan: every sample but the last, the first one twice
            await mark(js, plan, index)
        with pytest.raises(nats.js.errors.APIError):  # a marker is stored once
            await mark(js, plan, 0)
        await nc.drain()
        return plan

    plan = asyncio.run(setup())
    view = status(hsx, job_name, None)
    assert view["batches_queued"] == 0 and view["files_waiting_upload"] == 0, view
    assert not view["done"], view
    assert view["samples_uploaded"] == SAMPLES - 1, view
    assert view["samples_outside_plan"] == SAMPLES and view["events_other_plan"] == SAMPLES, view
    # The sums count each of this plan's markers once, and nothing set aside.
    assert (view["tokens_uploaded"], view["bytes_uploaded"]) == (8 * (SAMPLES - 1), 100 * (SAMPLES - 1)), view

    async def last_one() -> None:
        nc = await nats.connect(nats_server.url)
        await mark(nc.jetstream(), plan, SAMPLES - 1)
        await nc.drain()

    asyncio.run(last_one())
    view = status(hsx, job_name, None)
    assert view["done"] and view["samples_uploaded"] == SAMPLES, view


def _logged(proc, event: str) -> list[dict]:
    """The records of `event` in a service's JSON log."""
    lines = Path(proc.log_path).read_text(errors="replace").splitlines()
    return [r for r in (json.loads(line) for line in lines if line.startswith("{")) if r.get("event") == event]


@pytest.mark.faults
def test_a_descriptor_with_extra_samples_is_refused_and_does_not_count_toward_done(
    hsx, hsx_service, nats_server, tiny_model, job_name, tmp_path
):
    out = _produce(hsx, tmp_path, job_name, tiny_model("qwen3"))

    async def swap() -> tuple[bytes, str]:
        """Take one planned batch out of the queue; publish a descriptor of two extra samples."""
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        first = await js.get_msg(topology.BATCHES_STREAM, seq=1, subject=topology.batch_subject(job_name), next=True)
        await js.delete_msg(topology.BATCHES_STREAM, first.seq)
        extra = {
            "type": "batch.v1",
            "job": job_name,
            "batch_id": f"{job_name}-extra",
            "padded_len": 8,
            "samples": [
                {
                    "type": "sample.v1",
                    "index": SAMPLES + i,
                    "source_id": f"x{i}",
                    "input_ids": [1, 2, 3, 4, 5, 6, 7, 8 + i],
                }
                for i in range(2)
            ],
        }
        await js.publish(
            topology.batch_subject(job_name), msgspec.json.encode(extra), headers={"Nats-Msg-Id": extra["batch_id"]}
        )
        plan = await _plan_tag(js, job_name)
        await nc.drain()
        return first.data, plan

    held, plan = asyncio.run(swap())
    removed = sorted(sample["index"] for sample in json.loads(held)["samples"])
    assert len(removed) == 2, removed
    spool = str(tmp_path / "spool")
    workers = [
        hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, name="consume"),
        hsx_service("upload", "--job", job_name, "--spool", spool, name="upload"),
    ]
    consumer = workers[0]
    expected = {f"{i}.safetensors" for i in set(range(SAMPLES)) - set(removed)}

    # The planned batches left are extracted and uploaded; the extra one is refused and removed.
    deadline = time.monotonic() + 60
    while True:
        names = {p.name for p in (out / job_name).rglob("*.safetensors")}
        view = status(hsx, job_name, None)
        refused = _logged(consumer, "batch_refused")
        if names == expected and view["batches_queued"] == 0 and view["files_waiting_upload"] == 0 and refused:
            break
        assert all(w.poll() is None for w in workers), logs_of(*workers)
        assert time.monotonic() < deadline, f"{sorted(names)} after 60 s\n{logs_of(*workers)}"
        time.sleep(0.5)
    assert [(r["batch"], r["samples"], r["plan"]) for r in refused] == [
        (f"{job_name}-extra", [SAMPLES, SAMPLES + 1], plan)
    ], refused
    assert "outside the job's plan" in refused[0]["reason"], refused
    # Never extracted: no file of it in the spool or the destination, no marker, no dead letter.
    assert not [p for p in Path(spool).rglob("*.safetensors") if p.stem in {str(SAMPLES), str(SAMPLES + 1)}]
    assert not view["done"], view
    assert view["samples_uploaded"] == SAMPLES - 2 and view["samples_outside_plan"] == 0, view
    assert view["samples_written"] == SAMPLES - 2 and view["dead_letters"] == 0, view

    async def events_and_put_back() -> dict[str, list[dict]]:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        events = {
            kind: await _events(js, topology.markers_all(job_name, kind, "*")) for kind in ("written", "uploaded")
        }
        # The planned batch goes back (under a new message id: the old one is in the duplicate window).
        await js.publish(topology.batch_subject(job_name), held, headers={"Nats-Msg-Id": f"{job_name}-put-back"})
        await nc.drain()
        return events

    events = asyncio.run(events_and_put_back())
    # Consumer and uploader stamp every event with the job's plan, and made none for the extra samples.
    assert events["written"] and events["uploaded"]
    assert {event["plan"] for kind in events.values() for event in kind} == {plan}, events
    assert {event["sample_index"] for event in events["uploaded"]} == set(range(SAMPLES)) - set(removed), events
    wait_until_done(start_monitor(hsx_service, job_name, None), workers, timeout=60)
    view = status(hsx, job_name, None)
    assert view["done"] and view["samples_uploaded"] == SAMPLES and view["samples_outside_plan"] == 0, view
    assert "samples outside the plan" not in check_ok(hsx("status", "--job", job_name), "hsx status").stdout
    assert len(_logged(consumer, "batch_refused")) == 1
