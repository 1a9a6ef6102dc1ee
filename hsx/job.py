"""The job's own types, on the base floor: what a job is (`JobSpec`, which the producer records
and every worker, reader and command reads), the layers it selects (`Layer`, `FINAL`), the names
of its plan and batches (`plan_tag_of`, `plan_batch_id`), and the checked values they are made of
(`Name`, `Count`, ...), which the wire's messages (hsx/wire/schemas.py) use too.

The spec is a msgspec Struct tagged `job.v1`, as it was when it lived with the wire's messages:
the same JSON in the KV bucket `hsx_jobs` and in a job's `_hsx/job.json`. hsx/wire/ decodes it
(`schemas.job_decoder`) and checks what depends on its reader (`hsx/wire/jobs.py`); hsx/model/
resolves `--layers` into its `Layer`s; hsx/storage/ makes and reads the files it names. This
module imports nothing of hsx.
"""

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# Every value is checked where it is decoded (msgspec.Meta constraints: a payload that breaks one
# does not decode, and is poison): what becomes a NATS subject token or a path element is a name
# of safe characters, what is counted or summed is not negative, what names a plan is hex.
# What depends on the receiver (a job equal to its key and subject, an index inside the plan) is
# checked by the receiver (hsx/wire/jobs.py `read_job_spec`, the workers).
Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # a job or node: a subject token, a folder
Fingerprint = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
# Counts, sizes and indices fit a signed 64-bit integer, as readers store them (numpy int64
# arrays, the index's columns): msgspec alone would decode any integer JSON can write.
Count = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Positive = Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]

# The form of JobSpec.dtype, the name of the job's encoding as its files store it. Which names
# exist is hsx/storage/encodings/' registry's to say (hsx/storage/layout.py `SampleFiles`
# resolves it once); a decoder of the spec checks only that it is a name.
STORED_DTYPE_FORM = r"[a-z0-9][a-z0-9_-]{0,63}"

# A selected layer, as the job names it: a decoder layer index, or "final" (the post-norm final
# state). hsx/model/layers.py parses and resolves it; every layers field in hsx has this type.
FINAL = "final"  # the post-norm final state
# A resolved layer: a 0-based decoder layer index (its raw output), or FINAL.
Layer = Annotated[int, Meta(ge=0)] | Literal["final"]


def plan_tag_of(fingerprint: str) -> str:
    """A plan's short name (JobSpec.plan_tag): the first 12 characters of its fingerprint, as in
    the plan's batch ids (`plan_batch_id`)."""
    return fingerprint[:12]


def plan_batch_id(job: str, fingerprint: str, seq: int) -> str:
    """The id of the plan's `seq`-th batch: the same samples and settings (the plan's fingerprint)
    always give the same ids, which go out as `Nats-Msg-Id` and into the job bundle's plan."""
    return f"{job}-{plan_tag_of(fingerprint)}-{seq:06d}"


class JobSpec(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="job.v1"):
    """What a job is, recorded by the producer in the `hsx_jobs` KV bucket under the job name.

    Consumers and uploaders read everything they need from here, so their command lines stay short
    and every node works from the same settings.
    """

    job: Name
    model: str
    model_revision: str
    layers: Annotated[
        list[Layer], Meta(min_length=1)
    ]  # resolved decoder layer indices, or "final" (hsx/model/layers.py)
    dtype: str  # the encoding's stored name (hsx/storage/encodings/): bfloat16 | float8_e4m3 | ...
    dest: str
    token_budget: Positive
    max_seq_len: Positive
    dataset: str
    plan_fingerprint: Fingerprint
    total_samples: Count
    total_tokens: Count
    total_batches: Count
    created_at: float
    published: bool = False  # all descriptors are in the stream; a re-run publishes nothing
    trust_remote_code: bool = False  # the model's own code may run (asked for with --trust-remote-code)
    # The samples as planned (tokenized once, after --on-long), in object store bucket hsx_datasets:
    # a producer re-run reads them from there, never re-reads or re-tokenizes the dataset.
    tokenized_object: str = ""  # "<job>.tokens.arrow"; "" for jobs made before it existed
    report_object: str = ""  # "<job>.report.json": which rows were truncated or skipped, and how chats were tokenized
    dataset_digest: str = ""  # sha256 of the dataset's bytes, to refuse a changed dataset on a re-run
    on_long: str = "error"  # --on-long: error | truncate | skip
    samples_truncated: Count = 0
    samples_skipped: Count = 0
    rows_bad: Count = 0  # rows set aside by --on-bad-row skip; listed in the report
    # Rows of the dataset read, bad ones included (0: a job from before it was recorded); more
    # than the samples where a row makes none, fewer where it makes several (--chat-as speculators).
    rows_read: Count = 0
    # --on-empty-mask: keep | skip | error; samples whose loss mask is all 0, kept or skipped as it
    # says (listed in the report); "keep" and 0 for jobs from before it was recorded.
    on_empty_mask: str = "keep"
    samples_empty_mask: Count = 0
    num_layers: Count = 0  # the model's decoder layers (0: a job from before it was recorded)
    layer_preset: str = ""  # --layers as a preset (dflash:5, eagle3, speculators), which `layers` resolves
    hidden_size: Count = 0  # the model's hidden size H of every file's [T, k, H] (0: a job from before it was recorded)
    # --chat-as: whose loss mask chat rows got: hsx | specforge:TEMPLATE | speculators (producer/conventions.py)
    chat_convention: str = "hsx"
    # A plan published in rounds (--round-rows): the round size, and the first sample of each round
    # published so far. The totals above grow with each round and `published` is set after the
    # last; the plan's fingerprint is fixed from the first (producer/rounds.py). 0 and []: one plan.
    round_rows: Count = 0
    round_starts: list[Count] = msgspec.field(default_factory=list)
    # Why the producer stopped before publishing the whole plan (a refusal found in a later round:
    # a bad row, a long one, no room); "" while it has not. The job is failed once what was
    # published has run; `hsx produce` again resumes it once the cause is gone (a changed dataset
    # or setting is another plan: the job is deleted first).
    stopped: str = ""
    # Every sample the spec names has its digest in bucket hsx_datasets
    # (hsx.storage.tokens.digests_object_name), stored before the spec named it: a consumer
    # extracts a descriptor's sample only when it is that sample. False: a job of an older hsx.
    sample_digests: bool = False

    @property
    def plan_tag(self) -> str:
        """The plan's short name, carried by progress events so that events of another plan under
        the same job name (a deleted and re-created job, stray publishers) never count toward this
        one; the same 12 characters as in the plan's batch ids (`plan_batch_id`)."""
        return plan_tag_of(self.plan_fingerprint)

    @property
    def last_decoder_layer(self) -> int | None:
        """The model's last decoder layer, where the spec tells it: from `num_layers`, or in a spec
        from before `num_layers` was recorded, from its `speculators` preset, whose layers end with
        it (hsx/model/layers.py); None otherwise."""
        if self.num_layers:
            return self.num_layers - 1
        if self.layer_preset == "speculators" and isinstance(self.layers[-1], int):
            return self.layers[-1]
        return None

    def owns(self, plan: str) -> bool:
        """Whether a message naming `plan` is of this spec's plan (messages from before they
        carried their plan name none, and are taken as the job's)."""
        return plan in ("", self.plan_tag)

    def plan_batch_seq(self, batch_id: str) -> int | None:
        """The sequence number in a batch id of the plan's form (`plan_batch_id`), whether or not
        the plan has that many batches; None for an id of another form."""
        prefix = plan_batch_id(self.job, self.plan_fingerprint, 0)[:-6]
        seq = batch_id.removeprefix(prefix)
        if seq == batch_id or len(seq) < 6 or not seq.isascii() or not seq.isdigit():
            return None
        return int(seq) if batch_id == plan_batch_id(self.job, self.plan_fingerprint, int(seq)) else None

    def is_plan_batch(self, batch_id: str) -> bool:
        """Whether `batch_id` is one of the plan's own batches (a re-queued sample's batch, a
        poisoned batch's retry or a dead letter's half is not: each holds samples of the plan, but
        counting it as a batch of the plan would count past `total_batches`)."""
        prefix = plan_batch_id(self.job, self.plan_fingerprint, 0)[:-6]
        seq = batch_id.removeprefix(prefix)
        return (
            seq.isdigit()
            and int(seq) < self.total_batches
            and batch_id == plan_batch_id(self.job, self.plan_fingerprint, int(seq))
        )
