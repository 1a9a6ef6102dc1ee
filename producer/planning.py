"""A job's plan: its batches, the fingerprint that names them, and its rounds.

A plan is made of rounds, each planned on its own as soon as its samples are read (hsx/packing.py
`plan_in_rounds`); the whole dataset read before anything is published is the plan of one round,
planned as `plan_batches` plans the whole. What names the plan differs: a plan of one round is
named by its samples (`plan_fingerprint`), as every hsx named it; a plan of several rounds is
fixed before its samples are all known, so `round_fingerprint` names it by the settings, the
dataset's bytes (their sha256) and the round size, which make the same samples and batches again.
A plan knows its batch ids (`batch_id`) and makes its descriptors (`descriptor`). Nothing of NATS
here: publishing a plan is producer/publishing.py's.
"""

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import structlog

from hsx.job import JobSpec, Layer, plan_batch_id, plan_tag_of
from hsx.packing import PlannedBatch, plan_batches, plan_in_rounds
from hsx.producer.config import ProducerConfig
from hsx.storage.tokens import SampleTable
from hsx.wire import schemas

log = structlog.get_logger("hsx.producer")


def plan_fingerprint(cfg: ProducerConfig, layers: list[Layer], samples: SampleTable) -> str:
    """sha256 over the settings and, per sample in index order, its tokens as int64 bytes, its
    mask as int8 bytes (b"|" without one) and its source id and a newline. The byte stream is
    the one of every hsx before the columnar table (batch ids of existing jobs must not change),
    fed from the table a run of samples at a time."""
    digest = hashlib.sha256()
    digest.update(msgspec.json.encode([cfg.model, layers, cfg.dtype, cfg.token_budget, cfg.max_batch_size]))
    for first, offsets, tokens, masks in samples.runs():
        count = len(offsets) - 1
        wide = tokens.astype(np.int64)
        narrow = None if masks is None else masks.view(np.int8)
        ids = samples.source_ids.slice(first, count).to_pylist()
        has_mask = samples.has_mask[first : first + count].tolist()
        bounds = offsets.tolist()
        for k in range(count):
            start, end = bounds[k], bounds[k + 1]
            digest.update(wide[start:end])
            digest.update(narrow[start:end] if has_mask[k] else b"|")
            digest.update(ids[k].encode() + b"\n")
    return digest.hexdigest()


def round_fingerprint(
    cfg: ProducerConfig, layers: list[Layer], *, model_revision: str, dataset_digest: str, round_rows: int
) -> str:
    """sha256 over everything that decides a round plan's samples and batches: the model and its
    revision (its tokenizer), the layers and dtype, the batch settings, every setting that decides
    which rows become which samples, the dataset's digest and the round size."""
    settings = [
        "rounds.v1",
        cfg.model,
        model_revision,
        layers,
        cfg.dtype,
        cfg.token_budget,
        cfg.max_batch_size,
        cfg.max_seq_len,
        cfg.on_long,
        str(cfg.chat_as),
        cfg.chat_field,
        cfg.on_bad_row,
        None if cfg.max_bad_rows is None else str(cfg.max_bad_rows),
        cfg.on_empty_mask,
        dataset_digest,
        round_rows,
    ]
    return hashlib.sha256(msgspec.json.encode(settings)).hexdigest()


@dataclass(kw_only=True)
class Plan:
    """The batches of job `job` (sample indices the job's), named by `fingerprint`. `round_rows`
    and `round_starts` (the first sample of each round) are the spec's: 0 and [] for a plan of
    one round, which is not recorded as a plan in rounds."""

    job: str
    fingerprint: str
    batches: list[PlannedBatch]
    round_rows: int = 0
    round_starts: list[int] = field(default_factory=list)

    @classmethod
    def whole(cls, cfg: ProducerConfig, layers: list[Layer], rows: SampleTable) -> "Plan":
        """The plan of one round: every sample of `rows`, named by them."""
        batches = plan_batches(rows.lengths, token_budget=cfg.token_budget, max_batch_size=cfg.max_batch_size)
        return cls(job=cfg.job, fingerprint=plan_fingerprint(cfg, layers, rows), batches=batches)

    @classmethod
    def in_rounds(
        cls,
        cfg: ProducerConfig,
        layers: list[Layer],
        lengths,
        round_starts: list[int],
        *,
        model_revision: str,
        dataset_digest: str,
        round_rows: int,
    ) -> "Plan":
        """The plan of the rounds that start at `round_starts` (`lengths`: every sample's token
        count so far), named by the settings, the dataset's digest and the round size."""
        fingerprint = round_fingerprint(
            cfg, layers, model_revision=model_revision, dataset_digest=dataset_digest, round_rows=round_rows
        )
        plan = cls(job=cfg.job, fingerprint=fingerprint, batches=[], round_rows=round_rows)
        starts = [*round_starts, len(lengths)]
        for start, end in zip(starts, starts[1:]):
            plan.grow(cfg, np.asarray(lengths)[:end], start)
        return plan

    @classmethod
    def of_samples(
        cls,
        cfg: ProducerConfig,
        layers: list[Layer],
        rows: SampleTable,
        *,
        round_starts: list[int] | None = None,
        recorded: JobSpec | None = None,
    ) -> "Plan":
        """The plan of samples known whole: one round, or, with more than one of `round_starts`
        (a dry run's rounds, read but not published) or for `recorded`, a job on record that was
        published in rounds (its samples from the store), those rounds. A dry run reads no dataset
        digest: only its fingerprint's length counts there."""
        if recorded is not None and len(recorded.round_starts) > 1:
            return cls.in_rounds(
                cfg,
                layers,
                rows.lengths,
                recorded.round_starts,
                model_revision=recorded.model_revision,
                dataset_digest=recorded.dataset_digest,
                round_rows=recorded.round_rows,
            )
        if round_starts is not None and len(round_starts) > 1:
            return cls.in_rounds(
                cfg, layers, rows.lengths, round_starts, model_revision="", dataset_digest="", round_rows=cfg.round_rows
            )
        return cls.whole(cfg, layers, rows)

    @property
    def tag(self) -> str:
        return plan_tag_of(self.fingerprint)

    def grow(self, cfg: ProducerConfig, lengths, start: int) -> range:
        """Plan the round of samples `start` up to len(`lengths`) on its own, after the others;
        the sequence numbers of its batches."""
        before = len(self.batches)
        self.batches += plan_in_rounds(
            lengths, [start], token_budget=cfg.token_budget, max_batch_size=cfg.max_batch_size
        )
        self.round_starts.append(start)
        return range(before, len(self.batches))

    def batch_id(self, seq: int) -> str:
        return plan_batch_id(self.job, self.fingerprint, seq)

    def descriptor(self, seq: int, samples: SampleTable) -> schemas.BatchDescriptor:
        """The `seq`-th batch as it goes out, its tokens from `samples` (made when published or
        measured, one descriptor's tokens at a time)."""
        batch = self.batches[seq]
        return schemas.BatchDescriptor(
            job=self.job,
            batch_id=self.batch_id(seq),
            padded_len=batch.padded_len,
            samples=[samples.sample(i) for i in batch.sample_indices],
            plan=self.tag,
        )

    def descriptors(self, seqs: Iterable[int], samples: SampleTable) -> Iterator[schemas.BatchDescriptor]:
        """The descriptors of `seqs`, made one at a time (the preflight check measures and drops each)."""
        for seq in seqs:
            yield self.descriptor(seq, samples)

    def packing_efficiency(self, samples: SampleTable) -> float:
        return round(samples.total_tokens / max(1, sum(b.padded_tokens for b in self.batches)), 4)

    def log_ready(self, samples: SampleTable, *, from_store: bool) -> None:
        log.info(
            "plan_ready",
            job=self.job,
            samples=len(samples),
            batches=len(self.batches),
            tokens=samples.total_tokens,
            packing_efficiency=self.packing_efficiency(samples),
            fingerprint=self.fingerprint[:12],
            from_store=from_store,
        )
