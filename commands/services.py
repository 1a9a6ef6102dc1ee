"""Each service's frozen config, from the resolved flags of its command, and running it.

The flags themselves are declared on the config classes (hsx/config/fields.py). What is finished
here is what no flag says alone: the node named after the host, the process's own instance, the
spool made absolute and created, `--wait-for-job`'s bound under `--until-done`, the high-water
mark `auto` measured on the spool's disk, the monitor's `auto` format. `hsx consume` and `hsx up`
(for each consumer it starts) build a consumer's config with the same function.
"""

import argparse
import asyncio
import dataclasses
import os
import socket
import sys

from hsx.config.fields import flag_fields
from hsx.config.settings import build_config
from hsx.config.values import parse_size
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.monitor.config import MonitorConfig
from hsx.producer.config import ProducerConfig
from hsx.storage.fsutil import free_bytes, make_private_dirs
from hsx.uploader.config import UploaderConfig
from hsx.wire.natsconn import NatsSettings
from hsx.wire.topology import node_name
from hsx.wire.worker import UNTIL_DONE_WAIT_FOR_JOB_S, WorkerConfig

ServiceConfig = ProducerConfig | ConsumerConfig | UploaderConfig | MonitorConfig

# The command that runs each service, as `hsx up` names its children.
COMMANDS: dict[type, str] = {
    ProducerConfig: "produce",
    ConsumerConfig: "consume",
    UploaderConfig: "upload",
    MonitorConfig: "monitor",
}


def nats_settings(args: argparse.Namespace) -> NatsSettings | None:
    """The connection of a command with NATS flags; None for one without, or for `hsx up` with no
    --nats (it starts its own server)."""
    fields = [field.name for field, _ in flag_fields(NatsSettings)]
    if not all(hasattr(args, name) for name in fields) or not args.url:
        return None
    return build_config(NatsSettings, args)


def process_instance(node: str) -> str:
    """Unique per process across machines and containers: every container's first process has
    the same pid, and a scaled compose service shares its node name."""
    host = socket.gethostname().split(".")[0]
    return f"{node}-{os.getpid()}" if host == node else f"{node}-{host}-{os.getpid()}"


def _worker_fields(args: argparse.Namespace, *, prepare: bool) -> dict:
    node = node_name(args.node or socket.gethostname())
    spool = args.spool.resolve()
    if prepare:
        make_private_dirs(spool)
    # --until-done bounds the wait for the job's spec unless --wait-for-job says otherwise.
    wait = args.wait_for_job_s
    if wait is None and args.until_done:
        wait = UNTIL_DONE_WAIT_FOR_JOB_S
    return {"node": node, "instance": process_instance(node), "spool": spool, "wait_for_job_s": wait}


# Each builder takes `prepare`: False for `hsx config show`, which builds the config for its
# checks only, so nothing is made on this machine (a spool) and nothing measured (its disk).


def producer_config(args: argparse.Namespace, nats: NatsSettings, *, prepare: bool = True) -> ProducerConfig:
    return build_config(ProducerConfig, args, nats=nats)


def consumer_config(args: argparse.Namespace, nats: NatsSettings, *, prepare: bool = True) -> ConsumerConfig:
    if prepare:  # a device this process cannot use is refused before anything is made (the spool)
        from hsx.gpu_consumer.model import usable_device

        usable_device(args.device)
    worker = _worker_fields(args, prepare=prepare)
    high_water = args.spool_high_water_bytes
    if high_water == "auto":  # left so unprepared: the spool's disk is measured once it exists
        high_water = free_bytes(worker["spool"]) // 2 if prepare else high_water
    elif isinstance(high_water, str):  # "200G", as written: checked when it was parsed
        high_water = parse_size(high_water, "--spool-high-water")
    return build_config(ConsumerConfig, args, nats=nats, spool_high_water_bytes=high_water, **worker)


def uploader_config(args: argparse.Namespace, nats: NatsSettings, *, prepare: bool = True) -> UploaderConfig:
    return build_config(UploaderConfig, args, nats=nats, **_worker_fields(args, prepare=prepare))


def monitor_config(args: argparse.Namespace, nats: NatsSettings, *, prepare: bool = True) -> MonitorConfig:
    # auto: a person watching gets the bar, a pipe or a log shipper gets JSON lines.
    output = args.output if args.output != "auto" else ("bar" if sys.stdout.isatty() else "json")
    return build_config(MonitorConfig, args, nats=nats, output=output, log_level=args.log_level)


BUILDERS = {
    "produce": producer_config,
    "consume": consumer_config,
    "upload": uploader_config,
    "monitor": monitor_config,
}


def in_this_process(cfg: ServiceConfig) -> ServiceConfig:
    """A worker's config built by another process (`hsx up`) with this process's own instance."""
    if isinstance(cfg, WorkerConfig):
        return dataclasses.replace(cfg, instance=process_instance(cfg.node))
    return cfg


def run_service(cfg: ServiceConfig) -> int:
    """Runs the service of `cfg` until it stops; its exit code."""
    if isinstance(cfg, ProducerConfig):
        from hsx.commands.measure import measure_states
        from hsx.producer.main import run

        return asyncio.run(run(cfg, measure=measure_states))
    if isinstance(cfg, ConsumerConfig):
        from hsx.gpu_consumer.main import run
    elif isinstance(cfg, UploaderConfig):
        from hsx.uploader.main import run
    else:
        from hsx.monitor.main import run
    return asyncio.run(run(cfg))
