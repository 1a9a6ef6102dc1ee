"""Every message hsx puts on the wire, in one place; the job spec the KV store holds is the
job's own type (hsx/job.py), decoded here like the messages (`job_decoder`).

Each is a frozen, keyword-only msgspec Struct tagged with its version (`batch.v1`, ...). They
evolve only by adding fields with defaults, so an older reader still decodes a newer message.
Payloads are JSON so that `nats sub` and `nats stream view` show them readably.

A payload that does not decode is poison: the receiver terminates it and dead-letters it, it
does not crash.
"""

from typing import Annotated, Generic, Literal, TypeVar

import msgspec
from msgspec import Meta

from hsx.job import Count, JobSpec, Name, Positive

# Every value is checked where it is decoded, as the job spec's are (hsx/job.py: `Name`, `Count`,
# `Positive`, the same checks): what becomes a NATS subject token is a name of safe characters,
# what is counted or summed is not negative, what names a plan is hex.
# A worker instance (`<node>-<host>-<pid>`): a subject token of its heartbeats.
Instance = Annotated[str, Meta(pattern=r"^[^.*>\s]{1,256}$")]
BatchId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,256}$")]  # a subject token of its markers
PlanTag = Annotated[str, Meta(pattern=r"^(?:[0-9a-f]{12})?$")]  # JobSpec.plan_tag; "" from older senders
Digest = Annotated[str, Meta(pattern=r"^(?:[0-9a-f]{64})?$")]  # a sha256; "" from older senders
# hsx.storage.sampledigest: what a sample is (its tokens, mask, source id); "" from older senders.
SampleDigest = Annotated[str, Meta(pattern=r"^(?:[0-9a-f]{32})?$")]
Seconds = Annotated[float, Meta(ge=0, le=1e12)]
TokenId = Annotated[int, Meta(ge=0, lt=1 << 31)]


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
    # When spool_files and spool_bytes were measured (time.time(); a consumer's count is its last
    # walk of the spool plus its own writes since, so the walk's start); 0: not said (older
    # senders), sent_at stands for it. A node's figure is the newest measurement of any of its workers.
    spool_measured_at: Seconds = 0.0
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
