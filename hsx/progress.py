"""A job's progress, folded from its events and JetStream's own queue state.

Counts are of distinct samples and batches: a redelivered batch announces its samples again,
and they are counted once. Where work stands (batches queued, files waiting for upload, dead
letters, redeliveries) is read from JetStream itself, never inferred from processes. The monitor
keeps a tracker running; `hsx status` runs one until it has caught up with the stream, then
reads it once.

Only the job's plan counts: `written` and `uploaded` events carry the plan they belong to
(JobSpec.plan_tag); those of another plan under the same job name are set aside, and so are
sample indices outside the plan. `done` means every planned sample is in the destination, never
that enough events arrived.
"""

import asyncio
import time
from dataclasses import dataclass, field

import msgspec
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from hsx import schemas, topology

log = structlog.get_logger("hsx.progress")


@dataclass
class QueueState:
    batches_queued: int = 0
    files_queued: int = 0
    dead_letters: int = 0
    batch_redeliveries: int = 0
    file_redeliveries: int = 0


@dataclass
class ProgressFold:
    """Pure fold of progress events; knows nothing about NATS.

    `plan` (JobSpec.plan_tag) set: `written` and `uploaded` events of another plan are counted in
    `other_plan_events` and otherwise ignored. Events without a plan (from hsx before events
    carried one) are taken as this plan's, so a job running across an upgrade still finishes.
    """

    plan: str = ""
    other_plan_events: int = 0
    batches: dict[str, int] = field(default_factory=dict)  # batch id -> tokens
    batch_attempts: dict[str, int] = field(default_factory=dict)  # batch id -> highest delivery written
    file_attempts: dict[int, int] = field(default_factory=dict)  # sample -> highest delivery uploaded
    written: set[int] = field(default_factory=set)
    uploaded: dict[int, tuple[int, int]] = field(default_factory=dict)  # sample -> (tokens, bytes)
    dead_samples: set[int] = field(default_factory=set)
    dead_batches: set[str] = field(default_factory=set)
    bytes_written: int = 0
    tokens_written: int = 0
    heartbeats: dict[str, schemas.Heartbeat] = field(default_factory=dict)
    requeued: list[int] = field(default_factory=list)  # samples sent back for extraction, once per loss

    def apply(self, event: schemas.Event) -> None:
        if isinstance(event, (schemas.BatchWritten, schemas.FileUploaded)) and self.plan and event.plan not in ("", self.plan):
            self.other_plan_events += 1
            return
        if isinstance(event, schemas.BatchWritten) and event.redo:
            self.written.update(event.sample_indices)
        elif isinstance(event, schemas.BatchWritten):
            if event.batch_id not in self.batches:
                self.batches[event.batch_id] = event.tokens
                self.tokens_written += event.tokens
                self.bytes_written += event.bytes
            self.batch_attempts[event.batch_id] = max(self.batch_attempts.get(event.batch_id, 0), event.attempt)
            self.written.update(event.sample_indices)
        elif isinstance(event, schemas.FileUploaded):
            self.uploaded.setdefault(event.sample_index, (event.tokens, event.size))
            self.file_attempts[event.sample_index] = max(self.file_attempts.get(event.sample_index, 0), event.attempt)
        elif isinstance(event, schemas.SampleRequeued):
            self.requeued.append(event.sample_index)
        elif isinstance(event, schemas.Heartbeat):
            self.heartbeats[event.instance] = event
        elif isinstance(event, schemas.DeadLetter):
            self.dead_samples.update(event.sample_indices)
            if event.batch_id:
                self.dead_batches.add(event.batch_id)

    @property
    def batch_redeliveries(self) -> int:
        """Redeliveries of batches that were then written (delivery n counts n - 1): JetStream's own
        `num_redelivered` forgets a redelivered message once it is acked, so a recovered crash
        would otherwise leave no trace in the counts."""
        return sum(attempt - 1 for attempt in self.batch_attempts.values())

    @property
    def file_redeliveries(self) -> int:
        return sum(attempt - 1 for attempt in self.file_attempts.values())

    @property
    def tokens_uploaded(self) -> int:
        return sum(tokens for tokens, _ in self.uploaded.values())

    @property
    def bytes_uploaded(self) -> int:
        return sum(size for _, size in self.uploaded.values())


class _Replay:
    """An ordered consumer over one subject, applying every message to the fold."""

    def __init__(self, js: JetStreamContext, stream: str, subject: str, fold: ProgressFold, decoder, deliver: DeliverPolicy):
        self.js, self.stream, self.subject, self.fold, self.decoder, self.deliver = js, stream, subject, fold, decoder, deliver
        self.caught_up = asyncio.Event()
        self.sub = None

    async def start(self) -> None:
        info = await self.js.stream_info(self.stream, subjects_filter=self.subject)
        if not sum((info.state.subjects or {}).values()):
            self.caught_up.set()
        self.sub = await self.js.subscribe(
            self.subject, stream=self.stream, cb=self._on_msg, ordered_consumer=True, deliver_policy=self.deliver
        )

    async def _on_msg(self, msg) -> None:
        try:
            self.fold.apply(self.decoder.decode(msg.data))
        except msgspec.DecodeError:
            log.warning("undecodable_event", subject=msg.subject)
        if msg.metadata.num_pending == 0:
            self.caught_up.set()

    async def stop(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()


class ProgressTracker:
    def __init__(self, js: JetStreamContext, job: str, *, plan: str = "", heartbeats: bool = False) -> None:
        self.js = js
        self.job = job
        self.fold = ProgressFold(plan=plan)
        self.queues = QueueState()
        subjects = [
            (topology.EVENTS_STREAM, topology.event_subject(job, "written"), schemas.event_decoder, DeliverPolicy.ALL),
            (topology.EVENTS_STREAM, topology.event_subject(job, "uploaded"), schemas.event_decoder, DeliverPolicy.ALL),
            (topology.EVENTS_STREAM, topology.event_subject(job, "requeued"), schemas.event_decoder, DeliverPolicy.ALL),
            (topology.DEAD_STREAM, topology.dead_subject_all(job), schemas.dead_decoder, DeliverPolicy.ALL),
        ]
        if heartbeats:
            subjects.append(
                (topology.EVENTS_STREAM, topology.heartbeats_subject_all(job), schemas.event_decoder, DeliverPolicy.LAST_PER_SUBJECT)
            )
        self._replays = [_Replay(js, stream, subject, self.fold, dec, deliver) for stream, subject, dec, deliver in subjects]

    async def start(self) -> None:
        for replay in self._replays:
            await replay.start()

    async def wait_caught_up(self, timeout: float | None = 120.0) -> None:
        await asyncio.wait_for(self._all_caught_up(), timeout)

    async def _all_caught_up(self) -> None:
        # One after the other, not gather(): a gather cancelled by the timeout leaves a future whose
        # CancelledError asyncio then logs as "never retrieved".
        for replay in self._replays:
            await replay.caught_up.wait()

    async def stop(self) -> None:
        for replay in self._replays:
            await replay.stop()

    async def refresh_queues(self) -> QueueState:
        job = self.job

        async def count(stream: str, subject: str) -> int:
            info = await self.js.stream_info(stream, subjects_filter=subject)
            return sum((info.state.subjects or {}).values())

        async def redelivered(stream: str, durable: str) -> int:
            try:
                return (await self.js.consumer_info(stream, durable)).num_redelivered or 0
            except nats.js.errors.NotFoundError:
                return 0

        # One upload durable per node, each filtered to hsx.files.<job>.<node>.
        file_redeliveries = sum(
            info.num_redelivered or 0
            for info in await self.js.consumers_info(topology.FILES_STREAM)
            if (info.config.filter_subject or "").split(".")[2:3] == [job]
        )
        self.queues = QueueState(
            batches_queued=await count(topology.BATCHES_STREAM, topology.batch_subject(job)),
            files_queued=await count(topology.FILES_STREAM, topology.files_subject_all(job)),
            dead_letters=await count(topology.DEAD_STREAM, topology.dead_subject_all(job)),
            batch_redeliveries=await redelivered(topology.BATCHES_STREAM, topology.gpu_durable(job)),
            file_redeliveries=file_redeliveries,
        )
        return self.queues


def destination_refusals(heartbeats: dict[str, schemas.Heartbeat], *, now: float, live_s: float) -> list[dict]:
    """Uploaders that say, in a heartbeat younger than `live_s`, that the destination refuses
    their writes; newest first. Told by live heartbeats, so a refusal ends with the uploader that
    saw it: a stopped or killed one leaves no stale failure behind for the next run."""
    refused = sorted(
        (beat for beat in heartbeats.values()
         if beat.service == "uploader" and beat.state == "refused" and now - beat.sent_at <= live_s),
        key=lambda beat: beat.sent_at, reverse=True,
    )
    return [{"uploader": beat.instance, "node": beat.node, "reason": beat.detail} for beat in refused]


def status_view(
    spec: schemas.JobSpec | None, fold: ProgressFold, queues: QueueState, *, job: str, now: float | None = None,
    live_s: float = 30.0,
) -> dict:
    """The fields of `hsx status --json` (DESIGN section 5), plus detail. Heartbeats older than
    `live_s` at `now` (default: the time now) are not taken as the word of a live worker."""
    total = spec.total_samples if spec else 0
    # Samples outside the plan (a descriptor published by hand, a stray event) are reported, never
    # counted: one of them must not stand in for a planned sample that is missing.
    outside_uploaded = [i for i in fold.uploaded if not 0 <= i < total]
    outside = set(outside_uploaded).union(i for i in fold.written if not 0 <= i < total)
    uploaded = len(fold.uploaded) - len(outside_uploaded)
    # Done: every planned sample has an `uploaded` event of this plan (distinct indices within
    # range(total), so their number is total only when none is missing) and nothing is left in
    # flight (a batch redelivered after a crash may still be queued although its samples were
    # already uploaded).
    drained = queues.batches_queued == 0 and queues.files_queued == 0
    done = spec is not None and spec.published and uploaded == total and drained
    dead_samples = {i for i in fold.dead_samples if i not in fold.uploaded}
    # Nothing is queued anywhere and every missing sample is dead: the job cannot finish by itself.
    failed = spec is not None and spec.published and not done and drained
    if failed:
        unfinished = set(range(total)).difference(fold.uploaded)
        failed = bool(unfinished) and unfinished <= dead_samples
    failure_reason = (
        f"{len(dead_samples)} samples dead-lettered and nothing else left to run (hsx dead list --job {job})"
        if failed else None
    )
    # A refusing destination (a missing bucket, bad credentials, a denied permission) is a failure
    # for as long as it lasts: nothing is uploaded until someone fixes it, then it clears by itself.
    refusals = [] if done else destination_refusals(fold.heartbeats, now=time.time() if now is None else now, live_s=live_s)
    if refusals:
        failed = True
        failure_reason = f"the destination refuses uploads: {refusals[0]['reason']}"
    return {
        "job": job,
        "exists": spec is not None,
        "total_samples": total,
        "total_tokens": spec.total_tokens if spec else 0,
        # --on-long: rows truncated to --max-seq-len or skipped; listed in the job's input report.
        "samples_truncated": spec.samples_truncated if spec else 0,
        "samples_skipped": spec.samples_skipped if spec else 0,
        "input_report": f"{topology.DATASETS_BUCKET}/{spec.report_object}" if spec and spec.report_object else None,
        "samples_written": len(fold.written) - len(outside.intersection(fold.written)),
        "samples_uploaded": uploaded,
        "tokens_written": fold.tokens_written,
        "tokens_uploaded": fold.tokens_uploaded - sum(fold.uploaded[i][0] for i in outside_uploaded),
        "bytes_written": fold.bytes_written,
        "bytes_uploaded": fold.bytes_uploaded - sum(fold.uploaded[i][1] for i in outside_uploaded),
        # Set aside, not counted: sample indices outside range(total_samples), and `written` or
        # `uploaded` events of another plan under this job name.
        "samples_outside_plan": len(outside),
        "events_other_plan": fold.other_plan_events,
        "batches_total": spec.total_batches if spec else 0,
        "batches_done": len(fold.batches),
        "batches_queued": queues.batches_queued,
        "files_waiting_upload": queues.files_queued,
        "dead_letters": queues.dead_letters,
        "dead_samples": sorted(dead_samples),
        "samples_requeued": len(fold.requeued),
        # Written after a redelivery (from events) + redelivered and not acked yet (from JetStream).
        "batch_redeliveries": fold.batch_redeliveries + queues.batch_redeliveries,
        "file_redeliveries": fold.file_redeliveries + queues.file_redeliveries,
        "dest": spec.dest if spec else None,
        "done": done,
        "failed": failed,
        "failure_reason": failure_reason,  # one line; None unless failed
        "destination_error": refusals[0]["reason"] if refusals else None,
        "destination_refusals": refusals,  # [{uploader, node, reason}] of live uploaders refused
        "as_of": time.time(),
    }
