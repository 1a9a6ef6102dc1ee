"""`hsx upload`: connect, read the job spec (for the destination), bind to this node's durable,
and move files until stopped."""

import asyncio

import structlog

from hsx import topology
from hsx.destinations import open_destination
from hsx.events import EventPublisher, goodbye_heartbeat, heartbeat_loop
from hsx.fsutil import make_private_dirs
from hsx.jobs import wait_for_job_spec
from hsx.lifecycle import stop_event_on_signals
from hsx.natsconn import close_connection, connect
from uploader.config import UploaderConfig
from uploader.service import SERVICE, FileMover, pull_loop

log = structlog.get_logger("hsx.uploader")


async def run(cfg: UploaderConfig) -> int:
    stopping = stop_event_on_signals()
    structlog.contextvars.bind_contextvars(job=cfg.job, uploader=cfg.instance)
    make_private_dirs(cfg.spool)
    nc = await connect(cfg.nats, name=f"hsx-upload-{cfg.job}-{cfg.instance}")
    try:
        js = nc.jetstream()
        kv = await topology.ensure_topology(js)
        spec = await wait_for_job_spec(kv, cfg.job, stopping)
        if spec is None:
            return 0
        dest = open_destination(spec.dest, max_connections=cfg.max_inflight)
        events = EventPublisher(nc, js, cfg.job)
        durable = await topology.ensure_upload_consumer(js, cfg.job, cfg.node, ack_wait_s=cfg.ack_wait_s)
        sub = await js.pull_subscribe_bind(durable=durable, stream=topology.FILES_STREAM)
        mover = FileMover(cfg, dest, events, spec)
        log.info("uploader_ready", dest=dest.url, node=cfg.node, durable=durable, max_inflight=cfg.max_inflight)
        beats = asyncio.create_task(heartbeat_loop(
            events, service=SERVICE, instance=cfg.instance, node=cfg.node, interval_s=cfg.heartbeat_s, stopping=stopping,
            state=mover.heartbeat_state,
        ))
        try:
            await pull_loop(mover, sub, cfg, stopping)
        finally:
            beats.cancel()
            mover.close()
            await sub.unsubscribe()
            await goodbye_heartbeat(events, service=SERVICE, instance=cfg.instance, node=cfg.node, state=mover.heartbeat_state)
        log.info("uploader_stopped")
        return 0
    finally:
        await close_connection(nc)
