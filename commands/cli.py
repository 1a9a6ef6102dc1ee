"""The `hsx` command line: the parser of every command, and what each command runs.

A service's flags are declared on its config class (hsx/config/fields.py) and added here with
`add_config_flags`; commands/services.py builds the config and runs it. The commands that run
no service (status, verify, dead, ...) declare their few flags here, each environment variable with
`declare_env` (never read inline as a default) and a secret with `declare_secret`.
hsx/config/settings.py takes each value from the flag, the environment, the job file (`--config`,
hsx/config/configfile.py) or the default, in that order. A user error (`HsxError`) prints one
line, `hsx: error: ...`, and exits 2, with no traceback.
"""

import argparse
import asyncio
import os
import sys
from pathlib import Path

from hsx import __version__
from hsx.commands.services import BUILDERS, nats_settings, run_service
from hsx.commands.up import UP_JOB_DEFAULTS, UP_MADE, UpConfig
from hsx.config.settings import (
    Parser,
    add_config_flags,
    command_names,
    declare_command_line_only,
    declare_env,
    declare_job,
    declare_secret,
    describe,
    example_file,
    resolve,
)
from hsx.config.values import count, hide, positive_int
from hsx.errors import HsxError
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.logs import configure_logging
from hsx.monitor.config import MonitorConfig
from hsx.producer.config import ProducerConfig
from hsx.storage.trainers import DTYPES as EXPORT_DTYPES
from hsx.storage.trainers import FORMATS as EXPORT_FORMATS
from hsx.uploader.config import UploaderConfig
from hsx.wire.natsconn import NatsSettings, redact_url
from hsx.wire.topology import job_name


def _add_nats(parser: argparse.ArgumentParser, *, embedded: bool = False) -> None:
    """The connection flags (declared on NatsSettings). With `embedded` (hsx up): --nats names a
    server to use instead of starting one, and HSX_NATS_URL does not apply, because an exported
    URL would silently replace the embedded server; a job file's [nats] url does: a file is named
    on purpose."""
    if embedded:
        parser.add_argument("--nats", dest="url", default=None, help="use this NATS server instead of starting one")
        declare_secret(parser, url=redact_url)
    else:
        add_config_flags(parser, NatsSettings, only=lambda flag: flag.name == "--nats")
    auth = parser.add_argument_group("NATS credentials (prefer the environment for secrets: flags show in ps)")
    add_config_flags(auth, NatsSettings, only=lambda flag: flag.name != "--nats")


def _add_job(parser: argparse.ArgumentParser) -> None:
    """--job of a command that reads a job's state (status, dead, verify, ...): [job] name in a file."""
    parser.add_argument("--job", type=job_name, required=True, example="qwen27b-l5")
    declare_job(parser, job="name")


# Each service's command: its flags are its config's fields (hsx/config/fields.py).
_SERVICES = (
    ("produce", ProducerConfig, "plan batches and publish them for a job"),
    ("consume", ConsumerConfig, "run one GPU consumer for a job"),
    ("upload", UploaderConfig, "run one uploader for a job on this node"),
    ("monitor", MonitorConfig, "follow a job's progress as a log stream"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hsx", description="Hidden-state extraction over NATS JetStream.")
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="job file (TOML) with settings per command: flag > env > file > default "
        "(env HSX_CONFIG; none unless given; hsx config example writes one; hsx config show)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="env HSX_LOG_LEVEL, default info",
    )
    parser.add_argument("--version", action="version", version=f"hsx {__version__}")
    declare_env(parser, config="HSX_CONFIG", log_level="HSX_LOG_LEVEL")
    declare_command_line_only(parser, "config")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="run a whole job on this machine; starts what is not given")
    _add_nats(up, embedded=True)
    add_config_flags(up, UpConfig)
    # The job's flags are the producer's, with the demo's defaults (commands/up.py says why).
    add_config_flags(up, ProducerConfig, only=lambda flag: flag.job, defaults={**UP_JOB_DEFAULTS, **UP_MADE})

    for name, config, about in _SERVICES:
        service = commands.add_parser(name, help=about)
        _add_nats(service)
        add_config_flags(service, config)

    status = commands.add_parser("status", help="print a job's progress once")
    _add_nats(status)
    _add_job(status)
    status.add_argument("--json", action="store_true")
    status.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for NATS before giving up (default 120)"
    )
    status.add_argument(
        "--sums-budget",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds to spend adding up the markers the last reading had not (tokens, bytes, "
        "samples written); the counts and done never wait on it (default 0.5)",
    )

    verify = commands.add_parser("verify", help="check every sample file of a job in its destination")
    _add_nats(verify)
    _add_job(verify)
    verify.add_argument(
        "--recompute",
        type=count("--recompute"),
        default=0,
        metavar="K",
        help="also recompute K random samples on the CPU and compare (loads the model)",
    )
    verify.add_argument(
        "--seed",
        type=int,
        default=None,
        example=1234,
        help="seed for choosing the recomputed samples (default: random, reported)",
    )
    verify.add_argument(
        "--workers", type=positive_int("--workers"), default=16, help="objects read at once (default 16)"
    )
    verify.add_argument(
        "--list",
        action="store_true",
        help="list the job's folder even when its index is complete, to report stray keys too",
    )
    verify.add_argument("--json", action="store_true")

    index = commands.add_parser(
        "index",
        help="write a job's index of stored samples (<job>/_hsx/index.arrow), "
        "which readers use instead of listing; exit 1 if it is incomplete",
    )
    index_commands = index.add_subparsers(dest="index_command", required=True, metavar="ACTION")
    index_build = index_commands.add_parser(
        "build", help="from the job's uploaded events in NATS (what the monitor does when the job is done)"
    )
    _add_nats(index_build)
    _add_job(index_build)
    index_rebuild = index_commands.add_parser(
        "rebuild", help="from the destination alone: list the job's folder and read each file's header"
    )
    index_rebuild.add_argument(
        "job_url", metavar="JOB_URL", help="the job's folder: s3://bucket/prefix/JOB, file:///out/JOB or a path"
    )
    index_rebuild.add_argument(
        "--workers", type=positive_int("--workers"), default=32, help="headers read at once (default 32)"
    )
    for action in (index_build, index_rebuild):
        action.add_argument("--json", action="store_true")

    export = commands.add_parser(
        "export",
        help="write a finished job's samples as a drafter trainer reads them (SpecForge DFlash or EAGLE-3, "
        "speculators); no NATS: it reads the job's folder",
    )
    export.add_argument(
        "source", metavar="SOURCE", help="the job's folder: s3://bucket/prefix/JOB, file:///out/JOB or a path"
    )
    export.add_argument(
        "--to", required=True, choices=EXPORT_FORMATS, example="specforge-dflash", help="the trainer's format"
    )
    export.add_argument("out", type=Path, metavar="OUT", help="the folder to write (a rerun resumes it)")
    export.add_argument("--workers", type=positive_int("--workers"), default=16, help="samples at once (default 16)")
    export.add_argument(
        "--dtype",
        choices=EXPORT_DTYPES,
        default="auto",
        help="the hidden states' dtype in the export (default auto: the job's, float8 as bfloat16)",
    )
    export.add_argument("--json", action="store_true")

    sync = commands.add_parser(
        "sync", help="upload a directory (e.g. checkpoints) to a destination, again every --every"
    )
    sync.add_argument("path", type=Path, metavar="PATH", help="the directory whose files are uploaded")
    sync.add_argument(
        "--dest", required=True, example="s3://bucket/checkpoints", help="s3://bucket/prefix, file:///dir or a path"
    )
    sync.add_argument("--prefix", default="", help="key prefix under --dest (default: none)")
    passes = sync.add_mutually_exclusive_group(required=True)
    passes.add_argument("--every", example="30m", help="time from one pass's start to the next, e.g. 30m, 2h, 90s")
    passes.add_argument("--once", action="store_true", help="one pass, then exit (1 if a file could not be uploaded)")
    sync.add_argument(
        "--retries",
        type=positive_int("--retries"),
        default=5,
        help="attempts per file and pass, with backoff, before it is left to the next pass (default 5)",
    )

    dead = commands.add_parser("dead", help="list or retry a job's dead letters (HSX_DEAD)")
    dead_commands = dead.add_subparsers(dest="dead_command", required=True, metavar="ACTION")
    dead_list = dead_commands.add_parser("list", help="show each dead letter: samples, deliveries, error")
    dead_retry = dead_commands.add_parser("retry", help="send dead letters back to their queue")
    for action in (dead_list, dead_retry):
        _add_nats(action)
        _add_job(action)
        action.add_argument("--json", action="store_true")
    selection = dead_retry.add_mutually_exclusive_group(required=True)
    selection.add_argument(
        "--seq",
        type=positive_int("--seq"),
        action="append",
        help="the dead letter's sequence number from `hsx dead list` (repeatable)",
    )
    selection.add_argument("--all", action="store_true", help="every dead letter of the job")
    # Which samples to retry is asked for per run; a file must not retry anything by itself.
    declare_command_line_only(dead_retry, "seq", "all")

    jobs = commands.add_parser("jobs", help="list the jobs NATS holds, or delete one so that its name can be reused")
    jobs_commands = jobs.add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    jobs_list = jobs_commands.add_parser(
        "list", help="each job: published, samples, batches and files queued, created, destination"
    )
    jobs_delete = jobs_commands.add_parser(
        "delete",
        help="purge a job's messages, durables, job spec and stored samples (not its output in the "
        "destination); refused while its workers are alive unless --force",
    )
    for action in (jobs_list, jobs_delete):
        _add_nats(action)
        action.add_argument("--json", action="store_true")
    jobs_delete.add_argument("job", type=job_name, metavar="JOB")
    jobs_delete.add_argument(
        "--force", action="store_true", help="delete even while workers of the job are alive (they lose their durables)"
    )
    # Deleting is asked for per run; a file must not force it.
    declare_command_line_only(jobs_delete, "force")

    config = commands.add_parser("config", help="inspect settings: hsx config show COMMAND, hsx config example")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser(
        "show",
        help="print COMMAND's effective settings and where each came from (flag, env, file, default); "
        "secrets are shown as ***",
    )
    show.add_argument("--json", action="store_true", help="as JSON")
    show.add_argument(
        "target",
        nargs=argparse.REMAINDER,
        metavar="COMMAND [FLAGS]",
        help="the command and any of its own flags, e.g. consume --device cuda:1",
    )
    declare_command_line_only(show, "json")
    config_commands.add_parser(
        "example",
        help="print a job file with every key a file may set, commented out, with its flag, help and "
        "default: hsx config example > hsx.toml",
    )

    return parser


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    nats = nats_settings(args)
    if args.command in BUILDERS:
        return run_service(BUILDERS[args.command](args, nats))
    if args.command == "status":
        from hsx.commands.status import format_status, read_status

        if args.timeout <= 0:
            raise HsxError(f"--timeout must be positive, got {args.timeout:g}")
        if args.sums_budget < 0:
            raise HsxError(f"--sums-budget must not be negative, got {args.sums_budget:g}")
        view = asyncio.run(read_status(nats, args.job, timeout_s=args.timeout, sums_budget_s=args.sums_budget))
        print(format_status(view, as_json=args.json))
        return 0
    if args.command == "dead":
        from hsx.commands.dead import run_list, run_retry

        if args.dead_command == "list":
            return run_list(nats, args.job, as_json=args.json)
        return run_retry(nats, args.job, seqs=None if args.all else args.seq, as_json=args.json)
    if args.command == "jobs":
        from hsx.commands.jobs import run_delete, run_list

        if args.jobs_command == "list":
            return run_list(nats, as_json=args.json)
        return run_delete(nats, args.job, force=args.force, as_json=args.json)
    if args.command == "verify":
        from hsx.commands.verify import fetch_job, format_report, verify

        spec, token_ids = asyncio.run(fetch_job(nats, args.job))
        report = verify(
            spec, token_ids, recompute=args.recompute, seed=args.seed, workers=args.workers, list_folder=args.list
        )
        print(format_report(report, as_json=args.json))
        return 0 if report.ok else 1
    if args.command == "index":
        from hsx.storage.index import format_summary, rebuild_job_index, run_build

        if args.index_command == "build":
            built = asyncio.run(run_build(nats, args.job))
        else:
            built = rebuild_job_index(args.job_url, workers=args.workers)
        print(format_summary(built, as_json=args.json))
        return 0 if built.complete else 1
    if args.command == "export":
        from hsx.commands.export import ExportConfig, export_exit_code, format_report, run_export

        report = run_export(
            ExportConfig(source=args.source, to=args.to, out=args.out, workers=args.workers, dtype=args.dtype)
        )
        print(format_report(report, as_json=args.json))
        return export_exit_code(report)
    if args.command == "sync":
        from hsx.commands.sync import (
            SyncConfig,
            check_source,
            dest_url,
            parse_duration,
            run_sync,
        )

        source = check_source(args.path)
        cfg = SyncConfig(
            source=source,
            dest=dest_url(args.dest, args.prefix, source=source),
            every_s=None if args.once else parse_duration(args.every, "--every"),
            retries=args.retries,
        )
        return run_sync(cfg)
    if args.command == "up":
        from hsx.commands.up import run_up

        return run_up(UpConfig.from_args(parser, args, nats=nats))
    raise AssertionError(args.command)


# Read by the S3 client itself (hsx/storage/destinations.py, boto3), not by a flag; shown by `hsx config
# show` so that one command answers "what will this process use".
_S3_ENVIRONMENT = {
    "AWS_ENDPOINT_URL_S3": redact_url,
    "AWS_ENDPOINT_URL": redact_url,
    "AWS_DEFAULT_REGION": str,
    "AWS_ACCESS_KEY_ID": str,
    "AWS_SECRET_ACCESS_KEY": hide,
    "AWS_SESSION_TOKEN": hide,
    "AWS_PROFILE": str,
}


def _show_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`hsx config show [--json] COMMAND [FLAGS]`: COMMAND's flags are parsed as if it ran, with
    the global flags given before `config`; nothing is started. A `--json` after COMMAND is
    config show's own when COMMAND has none."""
    commands = [name for name in command_names(parser) if name != "config"]
    target = list(args.target)
    if not target or target[0] not in commands:
        parser.error(f"config show: name a COMMAND ({', '.join(commands)}), e.g. hsx config show consume")
    global_flags = {dest: value for dest, value in vars(args).items() if dest in ("config", "log_level")}
    inner, unknown = parser.parse_known_args(target, namespace=argparse.Namespace(**global_flags))
    as_json = getattr(args, "json", False) or "--json" in unknown  # a flag not given is absent (settings.Parser)
    unknown = [arg for arg in unknown if arg != "--json"]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    resolution = resolve(parser, inner, os.environ, require=False)
    environment = {name: shown(os.environ[name]) for name, shown in _S3_ENVIRONMENT.items() if os.environ.get(name)}
    print(describe(resolution, environment, as_json=as_json))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "config" and args.config_command == "example":
            print(example_file(parser), end="")
            return 0
        if args.command == "config":
            return _show_config(parser, args)
        resolve(parser, args, os.environ)
    except HsxError as exc:
        print(f"hsx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    configure_logging(level=args.log_level)
    try:
        return _dispatch(parser, args)
    except HsxError as exc:
        print(f"hsx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
