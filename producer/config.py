"""The producer's settings. Each field that is a flag declares it here (hsx/config/fields.py): the
CLI's `hsx produce` flags, the job file's keys, `hsx config show` and `hsx up` are made from these
declarations, so a new setting is this field and the code that reads it."""

from dataclasses import dataclass
from pathlib import Path

from hsx.config.fields import option
from hsx.config.values import count, parse_size, positive_float, positive_int
from hsx.errors import HsxError
from hsx.model.layers import LayerRequest, parse_layers
from hsx.producer.conventions import HSX, ChatConvention, parse_chat_as
from hsx.storage import destinations, encodings
from hsx.storage.location import Location
from hsx.wire.natsconn import NatsSettings
from hsx.wire.topology import job_name

# What to do with a sample longer than max_seq_len (producer/lengths.py).
ON_LONG = ("error", "truncate", "skip")
# What to do with a row that cannot be a sample (producer/inputs.py, `BadRows`).
ON_BAD_ROW = ("error", "skip")
# What to do with a sample whose loss mask is all 0, nothing to train on (producer/inputs.py, `EmptyMasks`).
ON_EMPTY_MASK = ("keep", "skip", "error")


@dataclass(frozen=True, slots=True)
class BadRowCap:
    """--max-bad-rows: at most `limit` bad rows, or `limit` percent of the rows read when `percent`."""

    limit: float
    percent: bool = False

    def allows(self, bad: int, rows: int) -> bool:
        """Whether `bad` bad rows out of `rows` rows read (bad ones included) are within the cap."""
        return bad * 100 <= self.limit * rows if self.percent else bad <= self.limit

    def __str__(self) -> str:
        return f"{self.limit:g}%" if self.percent else str(int(self.limit))


def parse_max_bad_rows(text: str) -> BadRowCap:
    """`N` (a count, 0 or more) or `P%` (a percentage of the rows read, 0 to 100)."""
    text = text.strip()
    percent = text.endswith("%")
    number = text.removesuffix("%").strip()
    try:
        limit = float(number) if percent else int(number)
    except ValueError:
        raise HsxError(f"--max-bad-rows must be a count N or a percentage P%, got {text!r}") from None
    if not (0 <= limit <= 100 if percent else limit >= 0):
        raise HsxError(f"--max-bad-rows must be 0 or more (a percentage at most 100%), got {text!r}")
    return BadRowCap(limit=limit, percent=percent)


def _max_payload(text: str) -> int:
    return parse_size(text, "--max-payload")


def parse_chat_field(text: str) -> str:
    """--chat-field: a column name other than a token row's own."""
    name = text.strip()
    if not name or name in ("input_ids", "loss_mask", "id"):
        raise HsxError(f"--chat-field must name the column of the conversations, got {text!r}")
    return name


def stored_dtype(name: str) -> str:
    """--dtype's value as the job spec and the files name it: its encoding's stored name (the
    encoding itself is looked up from the spec, hsx/storage/layout.py `SampleFiles`)."""
    return encodings.by_name(name).stored


@dataclass(frozen=True, kw_only=True)
class ProducerConfig:
    nats: NatsSettings
    job: str = option(
        "--job",
        env="HSX_JOB",
        parse=job_name,
        job=True,
        file_key="name",
        example="qwen27b-l5",
        help="the job's name: it scopes subjects, consumers, the job spec and the output keys",
    )
    model: str = option(
        "--model",
        env="HSX_MODEL",
        job=True,
        example="/models/Qwen3-27B",
        help="a local model folder or an id in the local Hugging Face cache",
    )
    dataset: Path = option(
        "--dataset",
        env="HSX_DATASET",
        parse=Path,
        job=True,
        example="data.parquet",
        help="JSONL/Parquet file or datasets save_to_disk folder: input_ids rows or chat messages rows",
    )
    # As given: resolved against the model's depth by the producer.
    layers: LayerRequest = option(
        "--layers",
        env="HSX_LAYERS",
        parse=parse_layers,
        job=True,
        example="1,16,31,46,61",
        help="0-based decoder layer indices, e.g. 1,16,31 (-1 = last; final = after the final norm), or a "
        "trainer's preset: dflash:N (a DFlash draft of N layers), eagle3, speculators",
    )
    dest: Location = option(
        "--dest",
        env="HSX_DEST",
        parse=Location.parse,
        job=True,
        example="s3://bucket/hidden-states",
        help=f"where the sample files go: {destinations.forms()}",
    )
    dtype: str = option(
        "--dtype",
        env="HSX_DTYPE",
        default="bfloat16",
        parse=stored_dtype,
        job=True,
        help=f"{', '.join(encodings.names())} ("
        + "; ".join(f"{e.name}: {e.help}" for e in encodings.ENCODINGS.values() if e.help)
        + "; default %(default)s)",
    )
    token_budget: int = option(
        "--token-budget",
        env="HSX_TOKEN_BUDGET",
        default=16384,
        parse=positive_int("--token-budget"),
        job=True,
        help="tokens per batch, batch size x padded length (default %(default)s)",
    )
    max_seq_len: int = option(
        "--max-seq-len",
        env="HSX_MAX_SEQ_LEN",
        default=4096,
        parse=positive_int("--max-seq-len"),
        job=True,
        help="the longest sample, in tokens; a longer one is --on-long's (default %(default)s)",
    )
    max_batch_size: int | None = option(
        "--max-batch-size",
        env="HSX_MAX_BATCH_SIZE",
        default=None,
        parse=positive_int("--max-batch-size"),
        job=True,
        example=64,
        help="samples per batch at most (default: no limit besides --token-budget)",
    )
    # Rounds: the GPUs start after one round is tokenized, not the whole dataset; the price is a
    # little packing (each round is sorted by length on its own; bench/packing.py --rounds).
    round_rows: int = option(
        "--round-rows",
        env="HSX_ROUND_ROWS",
        default=100_000,
        parse=count("--round-rows"),
        job=True,
        help="publish the plan in rounds of this many dataset rows, each sorted by length on its own, so the "
        "first batches go out once the first round is tokenized (default %(default)s; 0: one plan over the "
        "whole dataset, published once it is all read; a dataset of at most this many rows is one plan either way)",
    )
    on_long: str = option(
        "--on-long",
        env="HSX_ON_LONG",
        default="error",
        choices=ON_LONG,
        job=True,
        help="a sample longer than --max-seq-len: error (default), truncate to its first --max-seq-len "
        "tokens, or skip it; truncated and skipped rows are counted in hsx status and listed in the job's report",
    )
    on_bad_row: str = option(
        "--on-bad-row",
        env="HSX_ON_BAD_ROW",
        default="error",
        choices=ON_BAD_ROW,
        job=True,
        help="a row that cannot be a sample (bad JSON, no ids or conversation, a conversation the chat template "
        "cannot render, ids outside the vocabulary): error (default) names it and stops, skip sets it aside; "
        "skipped rows are counted in hsx status and listed in the job's report",
    )
    on_empty_mask: str = option(
        "--on-empty-mask",
        env="HSX_ON_EMPTY_MASK",
        default="keep",
        choices=ON_EMPTY_MASK,
        job=True,
        help="a sample whose loss mask is all 0, nothing to train on (a chat row with no assistant reply the "
        "template marks, a mask --on-long truncate cut away, a token row's all-zero loss_mask): keep (default) "
        "extracts it as the trainers' own preprocessing keeps it, skip sets it aside, error names the first and "
        "stops; they are counted in the log and listed in the job's report",
    )
    max_bad_rows: BadRowCap | None = option(
        "--max-bad-rows",
        env="HSX_MAX_BAD_ROWS",
        default=None,
        parse=parse_max_bad_rows,
        job=True,
        example="1%",
        help="with --on-bad-row skip, refuse the dataset when more rows than this are bad: a count N or a "
        "percentage P%% of the rows read (default: no limit; with --on-bad-row error the first bad row stops the job)",
    )
    trust_remote_code: bool = option(
        "--trust-remote-code",
        env="HSX_TRUST_REMOTE_CODE",
        default=False,
        job=True,
        help="allow a model that ships its own Python code (it runs on every consumer)",
    )
    chat_field: str | None = option(
        "--chat-field",
        env="HSX_CHAT_FIELD",
        default=None,
        parse=parse_chat_field,
        job=True,
        example="dialogue",
        help="the column of the chat rows' conversations, role/content or ShareGPT from/value messages "
        "(default: messages, else conversations)",
    )
    chat_as: ChatConvention = option(
        "--chat-as",
        env="HSX_CHAT_AS",
        default=HSX,
        parse=parse_chat_as,
        job=True,
        example="specforge:qwen",
        help="whose loss mask chat rows get: hsx (default: the assistant's replies as the model's template renders "
        "them), specforge:TEMPLATE (SpecForge 0.2.0's preprocess_conversations with its template TEMPLATE, e.g. "
        "qwen, qwen3-instruct, llama3) or speculators (speculators 0.9.0's: one sample per assistant turn)",
    )
    # Command line only: a job file that said so would replace another plan's files on every run,
    # long after the user meant it for one.
    replace_output: bool = option(
        "--replace-output",
        default=False,
        command_line_only=True,
        help="let this job take over its folder <dest>/<job> when it holds another plan's files (a deleted job "
        "of this name): that plan's bundle and index are removed, its sample files overwritten as this job writes",
    )
    # Command line only, as --replace-output: a job file that said so would run every job past a full disk.
    ignore_free_space: bool = option(
        "--ignore-free-space",
        default=False,
        command_line_only=True,
        help="run even when a local --dest (file:///dir or a path) has less free space than the job's sample "
        "files and bundle need (by default such a job is refused before anything is published)",
    )
    # The dry run (producer/estimate.py) and its own flags: command line only, a question asked once.
    dry_run: bool = option(
        "--dry-run",
        default=False,
        command_line_only=True,
        help="read, tokenize and plan the job as a run would, then print its samples, tokens, batches, largest "
        "batch and bytes (sample files at --dtype; the job bundle apart) and publish, store and write nothing; "
        "needs no NATS server",
    )
    as_json: bool = option(
        "--json", default=False, command_line_only=True, help="with --dry-run: print one JSON object"
    )
    max_payload: int | None = option(
        "--max-payload",
        default=None,
        parse=_max_payload,
        command_line_only=True,
        example="8M",
        help="with --dry-run: the NATS server max_payload the batches are checked against (default 1M, "
        "nats-server's default; a real run uses its server's)",
    )
    rate: float | None = option(
        "--rate",
        default=None,
        parse=positive_float("--rate", "tokens per second"),
        command_line_only=True,
        metavar="TOKENS_PER_S",
        example=27000,
        help="with --dry-run: tokens per second per GPU (the monitor's tok/s of one consumer), for the hours",
    )
    gpus: int = option(
        "--gpus",
        default=1,
        parse=positive_int("--gpus"),
        command_line_only=True,
        help="with --dry-run --rate: GPUs the job runs on (default %(default)s)",
    )
    estimate_device: str = option(
        "--estimate-device",
        default="cpu",
        command_line_only=True,
        example="cuda:0",
        help="with --dry-run and a compressed --dtype: the torch device that runs the model's trunk on a sample "
        "of the job's tokens, to measure how its states compress (default %(default)s; none: do not measure; "
        "without torch, or for a trunk larger than half the device's free memory, the dry run gives the bound "
        "alone and says why)",
    )
    # Servers of a JetStream cluster holding each hsx stream and bucket; None keeps what exists
    # (R1 when creating). docs/operations/multi-node.md.
    replicas: int | None = option(
        "--replicas",
        default=None,
        parse=positive_int("--replicas"),
        env="HSX_REPLICAS",
        example=3,
        help="servers of a JetStream cluster that hold each hsx stream and bucket, e.g. 3 "
        "(env HSX_REPLICAS; default: keep what exists, 1 when creating)",
    )

    def __post_init__(self) -> None:
        if not self.dry_run:
            given = [
                flag
                for flag, value in (
                    ("--json", self.as_json),
                    ("--max-payload", self.max_payload is not None),
                    ("--rate", self.rate is not None),
                    ("--gpus", self.gpus != 1),
                    ("--estimate-device", self.estimate_device != "cpu"),
                )
                if value
            ]
            if given:
                raise HsxError(f"{', '.join(given)}: only with --dry-run")
        if self.token_budget < self.max_seq_len:
            raise HsxError(
                f"--token-budget {self.token_budget} is smaller than --max-seq-len {self.max_seq_len}: "
                "the longest allowed sample must fit in one batch"
            )
