"""Every message hsx puts on the wire or in the KV store, in one place.

Each is a frozen, keyword-only msgspec Struct tagged with its version (`batch.v1`, ...). They
evolve only by adding fields with defaults, so an older reader still decodes a newer message.
Payloads are JSON so that `nats sub` and `nats stream view` show them readably.

A payload that does not decode is poison: the receiver terminates it and dead-letters it, it
does not crash.
"""

from typing import Annotated, Generic, Literal, TypeVar

import msgspec
from msgspec import Meta

# Every value is checked where it is decoded (msgspec.Meta constraints: a payload that breaks one
# does not decode, and is poison): what becomes a NATS subject token or a path element is a name
# of safe characters, what is counted or summed is not negative, what names a plan is hex.
# What depends on the receiver (a job equal to its key and subject, an index inside the plan) is
# checked by the receiver (hsx/wire/jobs.py `read_job_spec`, the workers).
Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # a job or node: a subject token, a folder
# A worker instance (`<node>-<host>-<pid>`): a subject token of its heartbeats.
Instance = Annotated[str, Meta(pattern=r"^[^.*>\s]{1,256}$")]
BatchId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,256}$")]  # a subject token of its markers
PlanTag = Annotated[str, Meta(pattern=r"^(?:[0-9a-f]{12})?$")]  # JobSpec.plan_tag; "" from older senders
Fingerprint = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
Digest = Annotated[str, Meta(pattern=r"^(?:[0-9a-f]{64})?$")]  # a sha256; "" from older senders
# hsx.storage.sampledigest: what a sample is (its tokens, mask, source id); "" from older senders.
SampleDigest = Annotated[str, Meta(pattern=r"^(?:[0-9a-f]{32})?$")]
# Counts, sizes and indices fit a signed 64-bit integer, as readers store them (numpy int64
# arrays, the index's columns): msgspec alone would decode any integer JSON can write.
Count = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Positive = Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
Seconds = Annotated[float, Meta(ge=0, le=1e12)]
TokenId = Annotated[int, Meta(ge=0, lt=1 << 31)]

# The form of JobSpec.dtype, the name of the job's encoding as its files store it. Which names
# exist is hsx/storage/encodings/' registry's to say (the consumer, readers and verify look the
# name up there); the wire, which imports no storage, checks only that it is a name.
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


class _Wire(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class Sample(_Wire, tag="sample.v1", omit_defaults=True):
    """One training sample, token ids inline so GPU nodes need no copy of the dataset.

    Its loss mask travels as `loss_spans`, the half-open [start, end) runs of 1s (a reply is one
    run: a few bytes instead of one int per token); `loss_mask`, one 0/1 per token, is what
    producers before spans sent and may still sit in a stream. Neither: the row has no mask;
    `loss_spans == []`: a mask of all 0s. Readers call `mask()`, which takes either. Fields at
    their default are left out of the JSON (older readers default them the same way)."""

    index: Count  # position in the job's dataset, 0-based; also the output file name
    source_id: str  # the row's `id` if it had one, else its row number
    input_ids: Annotated[list[TokenId], Meta(min_length=1)]
    loss_mask: list[Annotated[int, Meta(ge=0, le=1)]] | None = None
    loss_spans: list[tuple[Count, Count]] | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != len(self.input_ids):
            raise ValueError(f"sample {self.index}: {len(self.loss_mask)} mask values for {len(self.input_ids)} tokens")
        end = 0
        for start, stop in self.loss_spans or ():
            if not end <= start < stop <= len(self.input_ids):
                raise ValueError(f"sample {self.index}: loss span [{start}, {stop}) out of order or past its tokens")
            end = stop

    def mask(self) -> list[int] | None:
        """The per-token 0/1 loss mask, from `loss_spans` or `loss_mask`; None when the sample has none."""
        if self.loss_spans is None:
            return self.loss_mask
        mask = [0] * len(self.input_ids)
        for start, end in self.loss_spans:
            mask[start:end] = [1] * (end - start)
        return mask


class BatchDescriptor(_Wire, tag="batch.v1"):
    """One unit of GPU work: samples packed so that len(samples) * padded_len <= token budget."""

    job: Name
    batch_id: BatchId
    padded_len: Positive
    samples: Annotated[list[Sample], Meta(min_length=1)]
    # Set when an uploader re-queues a sample whose spool file was lost or corrupted; such a batch
    # is not one of the job's planned batches and is not counted as one.
    redo_reason: str = ""
    # JobSpec.plan_tag of the plan the batch belongs to: a worker serves one plan for its whole
    # life and never handles another's batch (a job deleted and produced again under its name).
    # "" from producers before it existed.
    plan: PlanTag = ""

    def __post_init__(self) -> None:
        longest = max(len(sample.input_ids) for sample in self.samples)
        if self.padded_len < longest:
            raise ValueError(
                f"batch {self.batch_id}: padded_len {self.padded_len} is below its longest sample's {longest}"
            )
        if len({sample.index for sample in self.samples}) != len(self.samples):
            raise ValueError(f"batch {self.batch_id}: a sample index is given twice")


class FileReady(_Wire, tag="file.v2", omit_defaults=True):
    """A complete sample file sits in a node's spool and waits for upload.

    It names its sample (`job`, `sample_index`, `plan`) rather than carrying it: the descriptor
    already carried the tokens once, and an uploader that must send a lost file's sample back
    for extraction reads it from the job's stored samples (`JobSpec.tokenized_object`). Fields at
    their default are left out of the JSON (older readers default them the same way)."""

    job: Name
    node: Name
    batch_id: BatchId
    sample_index: Count
    num_tokens: Positive
    spool_path: str  # relative to the spool directory; never read (the uploader derives the path)
    key: str  # destination key relative to the destination prefix; checked against the one derived
    size: Count
    digest: Digest  # hsx.storage.samplefile: sha256 of the file's header, which holds the sha256 of its data
    # The sample itself, as GPU consumers before references sent it (events of theirs may still
    # sit in a stream): re-queued from here when present. New events leave it out.
    sample: Sample | None = None
    # The writing consumer's JobSpec.plan_tag, passed on to the `uploaded` event; a lost file's
    # sample is taken from the stored samples only when they are this plan's.
    plan: PlanTag = ""
    # The sample's digest (hsx/storage/sampledigest.py), as the consumer checked it against the
    # plan's; passed on to the `uploaded` marker, which a reader checks the file's tokens against.
    sample_digest: SampleDigest = ""


class JobSpec(_Wire, tag="job.v1"):
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


# Progress events, on `hsx.events.<job>.<kind>`.


class BatchWritten(_Wire, tag="written.v1"):
    job: Name
    batch_id: BatchId
    consumer: Instance
    node: Name
    sample_indices: list[Count]
    tokens: Count
    bytes: Count
    seconds: Seconds
    attempt: Positive = 1
    redo: bool = False  # a re-queued sample, not a planned batch
    plan: PlanTag = ""  # JobSpec.plan_tag of the consumer's job spec; "" from consumers before it existed


class FileUploaded(_Wire, tag="uploaded.v1"):
    job: Name
    node: Name
    uploader: Instance
    sample_index: Count
    key: str
    size: Count
    tokens: Count
    already_present: bool = False
    attempt: Positive = 1  # delivery number of the file-ready event
    plan: PlanTag = ""  # JobSpec.plan_tag of the plan that wrote the file (FileReady.plan); "" from older senders
    # The stored object's digest (FileReady.digest, checked by the verified put): these events are
    # the journal the job's index is compacted from (hsx/storage/index.py); "" from older senders.
    digest: Digest = ""
    # FileReady.sample_digest: what the sample is, which the first marker of the sample fixes.
    sample_digest: SampleDigest = ""
    # Sent on `hsx.events.<job>.replaced.<plan>.<sample>`: the sample's marker was stored before,
    # and this upload stored its object again; the index takes this digest, no count or sum does.
    replaces: bool = False


class SampleRequeued(_Wire, tag="requeued.v1"):
    """An uploader found a spool file lost or corrupted and sent the sample back for extraction."""

    job: Name
    node: Name
    sample_index: Count
    reason: str


class Kernels(_Wire, tag="kernels.v1"):
    """The forward's implementations as transformers resolved them on a consumer's loaded model
    (gpu_consumer/kernels.py): `attention` (sdpa, eager, flash_attention_2, ...), and for the
    linear-attention layers of a hybrid model (Qwen3.5, Qwen3-Next) its delta rule
    (`linear_attention`: fla, or the torch fallback) and causal convolution (`conv1d`:
    causal_conv1d, fla (bound by hsx where causal-conv1d is missing), or torch); None for a model
    without such layers. `compiled`: the decoder layers run torch.compiled; `compile_error`: why a
    consumer asked to compile (--compile, or CUDA's default) runs eagerly instead, one line."""

    attention: str
    linear_attention: str | None = None
    conv1d: str | None = None
    compiled: bool = False
    compile_error: str = ""


class WorkerLoad(_Wire, tag="load.v1"):
    """How busy a worker is and what its node has left, as of one heartbeat: what the monitor's
    page shows per worker and per node. -1 (or None) where the worker does not measure it.

    `samples_per_s`: a GPU consumer's samples written, an uploader's samples stored, per second
    over its last minute. `in_hand`: batches (consumer) or files (uploader) taken and not yet
    settled. `busy`: the share of wall time a consumer's loop spent in the forward since its
    previous beat (0..1): low while it waits on its disk or its uploads. `gpu_*`: the device's
    utilization in percent and its memory in bytes, as nvidia-smi shows them (CUDA only;
    `gpu_utilization` needs NVML). `spool_free`: free bytes of the file system of the worker's
    spool; `spool_high_water`: the consumer's --spool-high-water in bytes."""

    device: str = ""  # a consumer's device (cuda:0, cpu); "" for other services
    samples_per_s: Annotated[float, Meta(ge=-1, le=1e9)] = -1.0
    in_hand: Annotated[int, Meta(ge=-1)] = -1
    busy: Annotated[float, Meta(ge=-1, le=1)] = -1.0
    gpu_utilization: Annotated[float, Meta(ge=-1, le=100)] = -1.0
    gpu_memory_used: Annotated[int, Meta(ge=-1)] = -1
    gpu_memory_total: Annotated[int, Meta(ge=-1)] = -1
    spool_free: Annotated[int, Meta(ge=-1)] = -1
    spool_high_water: Annotated[int, Meta(ge=-1)] = -1


class Heartbeat(_Wire, tag="heartbeat.v1"):
    job: Name
    service: str  # "gpu_consumer" | "uploader" | "producer"
    instance: Instance
    node: Name
    state: str  # "starting" | "working" | "idle" | "paused" | "disk_full" | "stalled" | "retrying" | "refused" | "stopping"
    # Why the worker is not working (paused, disk_full, retrying); free text. For "refused" (an
    # uploader whose destination refuses writes) the one-line reason, which `hsx status` reports.
    detail: str = ""
    sent_at: Seconds = 0.0
    # Added within heartbeat.v1 (defaults keep older senders and receivers working):
    last_batch: str = ""  # the batch a GPU consumer last started; "" for other services
    # The job's finished files in this node's spool when the beat was sent; -1: not measured.
    spool_files: int = -1
    spool_bytes: int = -1
    # With state "stalled": seconds the forward of `last_batch` has been running (past its bound).
    stalled_s: float = 0.0
    # The worker's spool directory on its node (absolute); "" for workers without one. `hsx jobs
    # delete --force` says from it where a deleted job's waiting files lie.
    spool: str = ""
    # A GPU consumer's kernels, once its model is loaded; None while it loads and for other services.
    kernels: Kernels | None = None
    # How busy the worker is and what its node has left (WorkerLoad); None from older senders.
    load: WorkerLoad | None = None


class DeadLetter(_Wire, tag="dead.v1"):
    """A message that could not be processed; stored in HSX_DEAD with what retrying it needs.

    A payload that decodes travels as itself (`batch` or `file`, plain JSON, readable in `nats
    stream view` and no larger than it was), so a letter is its payload plus a bounded envelope
    (`dead_letter_headroom`): it always fits where the payload fit. Only a payload that does not
    decode is kept as bytes in `original` (base64), cut to fit.
    """

    job: Name
    what: Literal["batch", "file"]
    error: str
    deliveries: Count
    original_subject: str
    original: bytes = b""  # a payload that does not decode, as it arrived (base64 in JSON); else empty
    batch_id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{0,256}$")] = ""
    sample_indices: list[Count] = []
    batch: BatchDescriptor | None = None  # the descriptor to send back, when what == "batch"
    file: FileReady | None = None  # the file-ready event to send back, when what == "file"
    source_seq: Count = 0  # the payload's sequence in its work-queue stream (0: not from one)
    original_truncated: bool = False  # `original` was cut to fit the server's max_payload


class ProgressCheckpoint(_Wire, tag="progress.v1"):
    """What a reader folded of a job's markers (hsx/wire/fold.py), saved for the next reader on
    `hsx.state.<job>.checkpoint`: each kind's sums over every marker of `plan` at or below its
    sequence of HSX_EVENTS, so the next fold reads only the markers after it."""

    job: Name
    plan: PlanTag
    written_seq: Count = 0
    samples_written: Count = 0
    tokens_written: Count = 0
    bytes_written: Count = 0
    batch_redeliveries: Count = 0  # deliveries before each batch was first written, less one each
    uploaded_seq: Count = 0
    tokens_uploaded: Count = 0
    bytes_uploaded: Count = 0
    file_redeliveries: Count = 0
    saved_at: Seconds = 0.0


class EpochEndRecord(_Wire, tag="epoch.v1"):
    """The end of a trainer stream's first epoch (hsx/wire/epochend.py `EpochEnd`), appended to
    `hsx.events.<job>.epoch.<plan>.<stream>` by a rank that found the job over: the stream
    sequence of its last marker, and whether the job was done or failed then. Every rank takes
    the first record there that the stream bears out (hsx/wire/epochend.py)."""

    job: Name
    plan: PlanTag
    stream: Name
    created_at: float  # the job's (JobSpec.created_at): an end of another production is not this one's
    end_seq: Count
    done: bool
    total_samples: Count
    reason: str | None = None
    missing: list[Count] = []
    missing_count: Count = 0


# A dead letter's error text is cut to this many characters.
DEAD_LETTER_ERROR_CHARS = 2000


def dead_letter_headroom(samples: int) -> int:
    """Bytes a dead letter may add around the payload it carries: the error (each character
    escaped as \\uXXXX at worst), subject, names and counters, and one index per sample. A
    descriptor of `samples` samples that fits max_payload minus this can always be dead-lettered."""
    return 6 * DEAD_LETTER_ERROR_CHARS + 1024 + 21 * samples


Event = BatchWritten | FileUploaded | SampleRequeued | Heartbeat | DeadLetter

EVENT_KINDS: dict[type, str] = {
    BatchWritten: "written",
    FileUploaded: "uploaded",
    SampleRequeued: "requeued",
    Heartbeat: "heartbeat",
    DeadLetter: "dead",
}

_encoder = msgspec.json.Encoder()
T = TypeVar("T")


class Decoder(Generic[T]):
    """A msgspec JSON decoder of one message type whose every refusal is a msgspec.DecodeError.
    msgspec raises RecursionError for JSON nested past Python's recursion limit (a few KiB of
    brackets, also inside an unknown field, which it skips by recursing): every receiver catches
    DecodeError as poison, so a payload nested that deep is made one too."""

    def __init__(self, type: type[T]) -> None:
        self._decoder = msgspec.json.Decoder(type)

    def decode(self, data: bytes | bytearray | memoryview | str) -> T:
        try:
            return self._decoder.decode(data)
        except RecursionError:
            raise msgspec.DecodeError("JSON is malformed: nested deeper than a message is") from None


batch_decoder = Decoder(BatchDescriptor)
file_decoder = Decoder(FileReady)
job_decoder = Decoder(JobSpec)
event_decoder = Decoder(Event)
dead_decoder = Decoder(DeadLetter)
checkpoint_decoder = Decoder(ProgressCheckpoint)
epoch_end_decoder = Decoder(EpochEndRecord)


def encode(message: _Wire) -> bytes:
    return _encoder.encode(message)
