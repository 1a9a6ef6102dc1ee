"""The job a run of `hsx produce` makes, as it stands at each step, without NATS (`Draft`): its
spec for a plan and the samples so far (`spec`), the counts of what reading the dataset set
aside (`counts`), the input report's document (`report`), and the job sized for the dry run and
the free-space check (`estimate`, `refuse_without_room`). It holds the settings, the model's
facts and the resolved layers, which every step of the run shares, and the job's encoding,
looked up once from the first spec it drafts. Publishing is producer/publishing.py's.
"""

import time
from dataclasses import asdict

import structlog

from hsx.job import JobSpec, Layer
from hsx.model.layers import preset_of
from hsx.model.modelinfo import ModelInfo
from hsx.producer.config import ProducerConfig
from hsx.producer.estimate import FreeSpace, JobEstimate, check_free_space, estimate_job
from hsx.producer.inputs import Inputs, report_document
from hsx.producer.measure import NO_MEASURE, Measure, NotMeasured
from hsx.producer.planning import Plan
from hsx.storage.encodings import Encoding
from hsx.storage.layout import SampleFiles
from hsx.storage.tokens import SampleTable, report_object_name, tokens_object_name

log = structlog.get_logger("hsx.producer")


class Draft:
    def __init__(self, cfg: ProducerConfig, info: ModelInfo, layers: list[Layer]) -> None:
        self.cfg, self.info, self.layers = cfg, info, layers
        self._encoding: Encoding | None = None

    def spec(
        self,
        plan: Plan,
        rows: SampleTable,
        *,
        created_at: float,
        tokenized_object: str,
        report_object: str,
        dataset_digest: str,
        counts: dict,
        published: bool = False,
    ) -> JobSpec:
        """The job's spec for `plan` and the samples so far, `rows`; `counts` as `counts` gives them."""
        cfg, info = self.cfg, self.info
        return JobSpec(
            job=cfg.job,
            model=cfg.model,
            model_revision=info.revision,
            layers=self.layers,
            layer_preset=preset_of(cfg.layers) or "",
            num_layers=info.num_layers,
            hidden_size=info.hidden_size,
            dtype=cfg.dtype,
            dest=str(cfg.dest),
            token_budget=cfg.token_budget,
            max_seq_len=cfg.max_seq_len,
            dataset=str(cfg.dataset),
            plan_fingerprint=plan.fingerprint,
            total_samples=len(rows),
            total_tokens=rows.total_tokens,
            total_batches=len(plan.batches),
            created_at=created_at,
            published=published,
            trust_remote_code=cfg.trust_remote_code,
            tokenized_object=tokenized_object,
            report_object=report_object,
            dataset_digest=dataset_digest,
            on_long=cfg.on_long,
            chat_convention=str(cfg.chat_as),
            sample_digests=True,
            round_rows=plan.round_rows,
            round_starts=list(plan.round_starts),
            **counts,
        )

    def files(self, spec: JobSpec) -> SampleFiles:
        """The spec's sample files; the encoding looked up from the first spec, then kept (every
        spec of the run names the same)."""
        if self._encoding is None:
            files = SampleFiles.of(spec)
            self._encoding = files.encoding
            return files
        return SampleFiles(spec, self._encoding)

    def counts(self, inputs: Inputs | None, existing: JobSpec | None) -> dict:
        """The job spec's fields that count what reading the dataset set aside: this run's, or the
        job on record's when its samples come from the store (`inputs` None)."""
        if inputs is not None:
            return {
                "samples_truncated": inputs.truncated,
                "samples_skipped": inputs.skipped,
                "rows_bad": len(inputs.bad_rows),
                "rows_read": inputs.rows_read,
                "on_empty_mask": self.cfg.on_empty_mask,
                "samples_empty_mask": len(inputs.empty_masks),
            }
        return {
            "samples_truncated": existing.samples_truncated,
            "samples_skipped": existing.samples_skipped,
            "rows_bad": existing.rows_bad,
            "rows_read": existing.rows_read,
            "on_empty_mask": existing.on_empty_mask,
            "samples_empty_mask": existing.samples_empty_mask,
        }

    def report(self, inputs: Inputs) -> dict:
        """The input report (`<job>/_hsx/report.json`, and the object store's copy)."""
        cfg = self.cfg
        return report_document(
            job=cfg.job,
            dataset=cfg.dataset,
            max_seq_len=cfg.max_seq_len,
            on_long=cfg.on_long,
            inputs=inputs,
            chat_as=str(cfg.chat_as),
            on_bad_row=cfg.on_bad_row,
            max_bad_rows=cfg.max_bad_rows,
            on_empty_mask=cfg.on_empty_mask,
        )

    def estimate(
        self,
        plan: Plan,
        rows: SampleTable,
        inputs: Inputs | None,
        existing: JobSpec | None,
        *,
        max_payload: int,
        measure: Measure | None = None,
    ) -> JobEstimate:
        """The job sized (producer/estimate.py) from its spec as it will be, but for the stored
        objects' names and the dataset's digest, which only the bundle's job.json holds (their
        length, not their value, counts; reading the dataset again for its digest would not). With
        `measure` (a dry run's), a compressed job's states are measured on --estimate-device."""
        cfg = self.cfg
        spec = self.spec(
            plan,
            rows,
            created_at=time.time(),
            tokenized_object=tokens_object_name(cfg.job),
            report_object=report_object_name(cfg.job),
            dataset_digest="0" * 64,
            counts=self.counts(inputs, existing),
        )
        files = self.files(spec)
        measured = not_measured = None
        if measure is not None and cfg.estimate_device == NO_MEASURE:
            not_measured = f"--estimate-device {NO_MEASURE}"
        elif measure is not None and not files.encoding.exact_size:
            try:
                measured = measure(files, rows, cfg.estimate_device)
                log.info("states_measured", job=cfg.job, **asdict(measured))
            except NotMeasured as exc:
                not_measured = str(exc)
                log.warning("states_not_measured", job=cfg.job, reason=not_measured)
        return estimate_job(
            files,
            rows,
            plan.batches,
            max_batch_size=cfg.max_batch_size,
            report=None if inputs is None else self.report(inputs),
            max_payload=max_payload,
            rate=cfg.rate,
            gpus=cfg.gpus,
            dest=cfg.dest,
            measured=measured,
            not_measured=not_measured,
        )

    def refuse_without_room(self, room: FreeSpace | None, **context) -> None:
        """Log the destination's free space against the job's need (`free_space_checked`), then
        refuse the job if it does not fit (check_free_space); `room` None: nothing to ask."""
        if room is not None:
            log.info(
                "free_space_checked",
                job=self.cfg.job,
                dest=str(self.cfg.dest),
                needed=room.needed,
                free=room.free,
                fits=room.fits,
                **context,
            )
        check_free_space(room)
