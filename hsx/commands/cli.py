"""The `hsx` command line: parses flags, builds each service's frozen config, runs it.

This is the only place that reads flags and environment variables. A user error (`HsxError`)
prints one line, `hsx: error: ...`, and exits 2, with no traceback.

Every flag is declared with its plain default; its environment variable is named with
`declare_env` (never read inline as the default) and a secret one is marked with
`declare_secret`. hsx/config/settings.py then takes each value from the flag, the environment, the job
file (`--config`, hsx/config/configfile.py) or the default, in that order.
"""

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path

from hsx import __version__
from hsx.config.settings import (
    Parser,
    command_names,
    declare_command_line_only,
    declare_env,
    declare_secret,
    describe,
    hide,
    positive_int,
    resolve,
)
from hsx.errors import HsxError
from hsx.logs import configure_logging
from hsx.wire.natsconn import DEFAULT_NATS_URL, NatsSettings, redact_url
from producer.config import ON_LONG

_ON_LONG_HELP = (
    "a sample longer than --max-seq-len: error (default), truncate to its first --max-seq-len tokens, "
    "or skip it; truncated and skipped rows are counted in hsx status and listed in the job's report"
)
DTYPES = ("bfloat16", "float16", "float32", "float8")  # float8 = e4m3 with a per-token scale
MONITOR_FORMATS = ("auto", "bar", "json")  # monitor/main.py


def _storage_dtype(name: str) -> str:
    return "float8_e4m3" if name == "float8" else name


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _metrics_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--metrics-port must be a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--metrics-port must be 0 (off) to 65535, got {port}")
    return port


_metrics_port.expects = int


def _path_not_contents(flag: str):
    """A file path flag that must never hold the file's contents: a pasted credentials file or key
    would then be shown as a value. The error does not quote the value."""

    def parse(text: str) -> str:
        if "\n" in text or "-----BEGIN" in text:
            raise argparse.ArgumentTypeError(f"{flag} takes the path of a file, not the file's contents")
        return text

    return parse


def parse_size(text: str, flag: str) -> int:
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = raw[-1] if raw and raw[-1] in _SIZE_UNITS else ""
    try:
        value = float(raw[: len(raw) - len(unit)]) * _SIZE_UNITS[unit]
    except ValueError:
        raise HsxError(f"{flag} {text!r}: not a size (e.g. 500G, 2T, 1048576)") from None
    if value <= 0:
        raise HsxError(f"{flag} {text!r}: must be positive")
    return int(value)


def _job_name(text: str) -> str:
    from hsx.wire.topology import check_name

    try:
        return check_name(text, "--job")
    except HsxError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_nats(parser: argparse.ArgumentParser, *, embedded: bool = False) -> None:
    if embedded:
        # No HSX_NATS_URL here: an exported URL would silently replace the embedded server.
        # A config file's [nats] url does apply: a file is named on purpose.
        parser.add_argument("--nats", default=None, help="use this NATS server instead of starting one")
    else:
        parser.add_argument(
            "--nats",
            default=DEFAULT_NATS_URL,
            help="NATS server URL(s), comma-separated (env HSX_NATS_URL, default %(default)s)",
        )
        declare_env(parser, nats="HSX_NATS_URL")
    auth = parser.add_argument_group("NATS credentials (prefer the environment for secrets: flags show in ps)")
    auth.add_argument("--nats-user", default=None, help="env HSX_NATS_USER")
    auth.add_argument("--nats-password", default=None, help="env HSX_NATS_PASSWORD")
    auth.add_argument("--nats-token", default=None, help="env HSX_NATS_TOKEN")
    auth.add_argument(
        "--nats-creds",
        type=_path_not_contents("--nats-creds"),
        default=None,
        help="credentials file (JWT + nkey), env HSX_NATS_CREDS",
    )
    auth.add_argument("--nats-tls-ca", default=None, help="CA bundle, env HSX_NATS_TLS_CA")
    auth.add_argument("--nats-tls-cert", default=None, help="client certificate, env HSX_NATS_TLS_CERT")
    auth.add_argument(
        "--nats-tls-key",
        type=_path_not_contents("--nats-tls-key"),
        default=None,
        help="client key, env HSX_NATS_TLS_KEY",
    )
    declare_env(
        parser,
        nats_user="HSX_NATS_USER",
        nats_password="HSX_NATS_PASSWORD",
        nats_token="HSX_NATS_TOKEN",
        nats_creds="HSX_NATS_CREDS",
        nats_tls_ca="HSX_NATS_TLS_CA",
        nats_tls_cert="HSX_NATS_TLS_CERT",
        nats_tls_key="HSX_NATS_TLS_KEY",
    )
    declare_secret(parser, nats=redact_url, nats_password=hide, nats_token=hide)


def _nats_settings(args: argparse.Namespace) -> NatsSettings | None:
    if not getattr(args, "nats", None):
        return None
    return NatsSettings(
        url=args.nats,
        user=getattr(args, "nats_user", None),
        password=getattr(args, "nats_password", None),
        token=getattr(args, "nats_token", None),
        creds_file=getattr(args, "nats_creds", None),
        tls_ca=getattr(args, "nats_tls_ca", None),
        tls_cert=getattr(args, "nats_tls_cert", None),
        tls_key=getattr(args, "nats_tls_key", None),
    )


def _node(given: str | None) -> str:
    """This node's name as a subject token: --node (or HSX_NODE, or the file), else the host name."""
    from hsx.wire.topology import node_name

    return node_name(given or socket.gethostname())


def _add_worker_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spool",
        type=Path,
        default=Path("hsx-spool"),
        help="local spool directory for finished files (env HSX_SPOOL, default ./hsx-spool)",
    )
    parser.add_argument("--node", default=None, help="this node's name (env HSX_NODE, default the host name)")
    parser.add_argument(
        "--ack-wait",
        type=float,
        default=60.0,
        help="seconds without a sign of life before JetStream redelivers a message (default 60)",
    )
    declare_env(parser, spool="HSX_SPOOL", node="HSX_NODE")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hsx", description="Hidden-state extraction over NATS JetStream.")
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="job file (TOML) with settings per command: flag > env > file > default "
        "(env HSX_CONFIG; none unless given; see hsx.toml.example, hsx config show)",
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
    up.add_argument(
        "--workdir", type=Path, default=Path("hsx-demo"), help="state, store, spool, logs (default ./hsx-demo)"
    )
    up.add_argument("--job", type=_job_name, default="demo")
    up.add_argument("--model", default=None, help="model folder or cached id (default: a small random model)")
    up.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="JSONL/Parquet file or datasets save_to_disk folder (default: synthetic)",
    )
    up.add_argument("--layers", default="1,3,5")
    up.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    up.add_argument("--dest", default=None, help="s3://bucket/prefix, file:///dir or a path (default WORKDIR/out)")
    up.add_argument(
        "--consumers",
        type=positive_int("--consumers"),
        default=1,
        help="consumers per device (default 1): --device cuda --consumers 2 on 4 GPUs starts 8",
    )
    up.add_argument("--uploaders", type=positive_int("--uploaders"), default=1)
    up.add_argument("--token-budget", type=positive_int("--token-budget"), default=4096)
    up.add_argument("--max-seq-len", type=positive_int("--max-seq-len"), default=1024)
    up.add_argument("--on-long", choices=ON_LONG, default="error", help=_ON_LONG_HELP)
    up.add_argument("--samples", type=positive_int("--samples"), default=256, help="synthetic dataset size")
    up.add_argument(
        "--device",
        default="cpu",
        help="where the consumers run: cpu (default), cuda:N, or cuda for every visible GPU "
        "(CUDA_VISIBLE_DEVICES honoured), one consumer per GPU",
    )
    up.add_argument(
        "--devices",
        default=None,
        metavar="LIST",
        help="with --device cuda: only these GPUs, e.g. 0,2 (default: every visible GPU)",
    )
    up.add_argument(
        "--compile", action="store_true", help="consumers torch.compile the decoder layers (hsx consume --compile)"
    )
    up.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model that ships its own Python code (hsx produce --trust-remote-code)",
    )
    up.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")

    produce = commands.add_parser("produce", help="plan batches and publish them for a job")
    _add_nats(produce)
    produce.add_argument("--job", type=_job_name, required=True)
    produce.add_argument("--model", required=True)
    produce.add_argument(
        "--dataset",
        type=Path,
        required=True,
        help="JSONL/Parquet file or datasets save_to_disk folder: input_ids rows or chat messages rows",
    )
    produce.add_argument("--layers", required=True, help="0-based decoder layer indices, e.g. 1,16,31 (-1 = last)")
    produce.add_argument("--dest", required=True)
    produce.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    produce.add_argument("--token-budget", type=positive_int("--token-budget"), default=16384)
    produce.add_argument("--max-seq-len", type=positive_int("--max-seq-len"), default=4096)
    produce.add_argument("--max-batch-size", type=positive_int("--max-batch-size"), default=None)
    produce.add_argument("--on-long", choices=ON_LONG, default="error", help=_ON_LONG_HELP)
    produce.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model that ships its own Python code (it runs on every consumer)",
    )
    produce.add_argument(
        "--replicas",
        type=positive_int("--replicas"),
        default=None,
        help="servers of a JetStream cluster that hold each hsx stream and bucket, e.g. 3 "
        "(env HSX_REPLICAS; default: keep what exists, 1 when creating)",
    )
    declare_env(produce, replicas="HSX_REPLICAS")

    consume = commands.add_parser("consume", help="run one GPU consumer for a job")
    _add_nats(consume)
    consume.add_argument("--job", type=_job_name, required=True)
    consume.add_argument("--device", default="cuda:0", help="env HSX_DEVICE, default cuda:0")
    _add_worker_flags(consume)
    consume.add_argument(
        "--spool-high-water",
        default="auto",
        help="pause fetching when the job's spool holds this many bytes (e.g. 200G; "
        "auto = half the spool disk's free space at start; env HSX_SPOOL_HIGH_WATER)",
    )
    consume.add_argument(
        "--retry-delay",
        type=float,
        default=2.0,
        help="a failing batch is retried after this many seconds x its delivery number "
        "(env HSX_RETRY_DELAY, default 2)",
    )
    consume.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decoder layers: a faster forward after ~20 s of compiling (env HSX_COMPILE=1)",
    )
    consume.add_argument(
        "--stall-after",
        type=float,
        default=300.0,
        help="a forward running 10x longer than its batch should take at this consumer's pace, "
        "and at least this many seconds, is stalled: its batch is released to another "
        "consumer and the heartbeat says so (default 300)",
    )
    declare_env(
        consume,
        device="HSX_DEVICE",
        spool_high_water="HSX_SPOOL_HIGH_WATER",
        retry_delay="HSX_RETRY_DELAY",
        compile="HSX_COMPILE",
    )

    upload = commands.add_parser("upload", help="run one uploader for a job on this node")
    _add_nats(upload)
    upload.add_argument("--job", type=_job_name, required=True)
    _add_worker_flags(upload)
    upload.add_argument("--max-inflight", type=positive_int("--max-inflight"), default=100)
    upload.add_argument(
        "--probe-every",
        type=float,
        default=30.0,
        help="while the destination refuses uploads (missing bucket, bad credentials, denied), "
        "try it again every this many seconds (env HSX_PROBE_EVERY, default 30)",
    )
    declare_env(upload, probe_every="HSX_PROBE_EVERY")

    monitor = commands.add_parser("monitor", help="follow a job's progress as a log stream")
    _add_nats(monitor)
    monitor.add_argument("--job", type=_job_name, required=True)
    monitor.add_argument("--until-done", action="store_true", help="exit 0 when done, 1 when it cannot finish")
    monitor.add_argument("--interval", type=float, default=5.0)
    monitor.add_argument(
        "--format",
        choices=MONITOR_FORMATS,
        default="auto",
        help="bar: one line redrawn in place; json: one JSON object per line; auto: bar when "
        "stdout is a terminal, else json (env HSX_MONITOR_FORMAT, default auto)",
    )
    monitor.add_argument(
        "--metrics-port",
        type=_metrics_port,
        default=0,
        help="serve Prometheus metrics on this port at /metrics, e.g. 9108 (env HSX_METRICS_PORT, default 0: off)",
    )
    monitor.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="address /metrics listens on (env HSX_METRICS_HOST, default %(default)s)",
    )
    monitor.add_argument(
        "--silent-after",
        type=float,
        default=30.0,
        help="report a worker whose last heartbeat is older than this many seconds (default 30)",
    )
    declare_env(monitor, format="HSX_MONITOR_FORMAT", metrics_port="HSX_METRICS_PORT", metrics_host="HSX_METRICS_HOST")

    status = commands.add_parser("status", help="print a job's progress once")
    _add_nats(status)
    status.add_argument("--job", type=_job_name, required=True)
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
    verify.add_argument("--job", type=_job_name, required=True)
    verify.add_argument(
        "--recompute",
        type=positive_int("--recompute"),
        default=0,
        metavar="K",
        help="also recompute K random samples on the CPU and compare (loads the model)",
    )
    verify.add_argument(
        "--seed", type=int, default=None, help="seed for choosing the recomputed samples (default: random, reported)"
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
    index_build.add_argument("--job", type=_job_name, required=True)
    index_rebuild = index_commands.add_parser(
        "rebuild", help="from the destination alone: list the job's folder and read each file's header"
    )
    index_rebuild.add_argument(
        "url", metavar="JOB_URL", help="the job's folder: s3://bucket/prefix/JOB, file:///out/JOB or a path"
    )
    index_rebuild.add_argument(
        "--workers", type=positive_int("--workers"), default=32, help="headers read at once (default 32)"
    )
    for action in (index_build, index_rebuild):
        action.add_argument("--json", action="store_true")

    sync = commands.add_parser(
        "sync", help="upload a directory (e.g. checkpoints) to a destination, again every --every"
    )
    sync.add_argument("path", type=Path, metavar="PATH", help="the directory whose files are uploaded")
    sync.add_argument("--dest", required=True, help="s3://bucket/prefix, file:///dir or a path")
    sync.add_argument("--prefix", default="", help="key prefix under --dest (default: none)")
    passes = sync.add_mutually_exclusive_group(required=True)
    passes.add_argument("--every", help="time from one pass's start to the next, e.g. 30m, 2h, 90s")
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
        action.add_argument("--job", type=_job_name, required=True)
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
    jobs_delete.add_argument("job", type=_job_name, metavar="JOB")
    jobs_delete.add_argument(
        "--force", action="store_true", help="delete even while workers of the job are alive (they lose their durables)"
    )
    # Deleting is asked for per run; a file must not force it.
    declare_command_line_only(jobs_delete, "force")

    config = commands.add_parser("config", help="inspect settings: hsx config show COMMAND")
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

    return parser


def _instance(node: str) -> str:
    """Unique per process across machines and containers: every container's first process has
    the same pid, and a scaled compose service shares its node name."""
    host = socket.gethostname().split(".")[0]
    return f"{node}-{os.getpid()}" if host == node else f"{node}-{host}-{os.getpid()}"


def _dispatch(args: argparse.Namespace) -> int:
    nats = _nats_settings(args)
    if args.command == "produce":
        from hsx.model.layers import parse_layers
        from hsx.storage.destinations import parse_dest
        from producer.config import ProducerConfig
        from producer.main import run

        cfg = ProducerConfig(
            nats=nats,
            job=args.job,
            model=args.model,
            dataset=args.dataset,
            layers=tuple(parse_layers(args.layers)),
            dest=parse_dest(args.dest),
            dtype=_storage_dtype(args.dtype),
            token_budget=args.token_budget,
            max_seq_len=args.max_seq_len,
            max_batch_size=args.max_batch_size,
            trust_remote_code=args.trust_remote_code,
            on_long=args.on_long,
            replicas=args.replicas,
        )
        return asyncio.run(run(cfg))
    if args.command == "consume":
        from gpu_consumer.config import ConsumerConfig
        from gpu_consumer.main import run
        from hsx.model.devices import check_consumer_device
        from hsx.storage.fsutil import free_bytes, make_private_dirs

        check_consumer_device(args.device)
        node = _node(args.node)
        make_private_dirs(args.spool)
        high_water = (
            free_bytes(args.spool) // 2
            if args.spool_high_water == "auto"
            else parse_size(args.spool_high_water, "--spool-high-water")
        )
        if not args.stall_after > 0:
            raise HsxError(f"--stall-after must be a positive number of seconds, got {args.stall_after}")
        cfg = ConsumerConfig(
            nats=nats,
            job=args.job,
            device=args.device,
            spool=args.spool.resolve(),
            node=node,
            instance=_instance(node),
            spool_high_water_bytes=high_water,
            ack_wait_s=args.ack_wait,
            retry_delay_s=args.retry_delay,
            compile_layers=args.compile,
            stall_after_s=args.stall_after,
        )
        return asyncio.run(run(cfg))
    if args.command == "upload":
        from uploader.config import UploaderConfig
        from uploader.main import run

        node = _node(args.node)
        if not args.probe_every > 0:
            raise HsxError(f"--probe-every must be a positive number of seconds, got {args.probe_every}")
        cfg = UploaderConfig(
            nats=nats,
            job=args.job,
            spool=args.spool.resolve(),
            node=node,
            instance=_instance(node),
            max_inflight=args.max_inflight,
            ack_wait_s=args.ack_wait,
            probe_every_s=args.probe_every,
        )
        return asyncio.run(run(cfg))
    if args.command == "monitor":
        from monitor.config import MonitorConfig
        from monitor.main import run

        # auto: a person watching gets the bar, a pipe or a log shipper gets JSON lines.
        output = args.format if args.format != "auto" else ("bar" if sys.stdout.isatty() else "json")
        return asyncio.run(
            run(
                MonitorConfig(
                    nats=nats,
                    job=args.job,
                    interval_s=args.interval,
                    until_done=args.until_done,
                    silent_after_s=args.silent_after,
                    output=output,
                    log_level=args.log_level,
                    metrics_port=args.metrics_port,
                    metrics_host=args.metrics_host,
                )
            )
        )
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
            built = rebuild_job_index(args.url, workers=args.workers)
        print(format_summary(built, as_json=args.json))
        return 0 if built.complete else 1
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
        from hsx.commands.up import UpConfig, run_up

        return run_up(UpConfig.from_args(args, nats=nats))
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
        if args.command == "config":
            return _show_config(parser, args)
        resolve(parser, args, os.environ)
    except HsxError as exc:
        print(f"hsx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    configure_logging(level=args.log_level)
    try:
        return _dispatch(args)
    except HsxError as exc:
        print(f"hsx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
