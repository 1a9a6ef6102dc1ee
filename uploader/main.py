"""`hsx upload`: connect, read the job spec (for the destination), bind to this node's durable,
and move files until stopped (with --until-done: until the job is over, hsx.wire.worker.JobEnd)."""

import asyncio

import structlog

from hsx.exitcodes import STOPPED
from hsx.storage.fsutil import make_private_dirs
from hsx.storage.location import open_destination, spec_location
from hsx.storage.spool import plan_folder, remove_plan_folder, remove_stale_plans, spool_usage
from hsx.uploader.config import UploaderConfig
from hsx.uploader.service import SERVICE, FileMover, pull_loop
from hsx.wire import topology
from hsx.wire.events import EventPublisher
from hsx.wire.health import Health, serving
from hsx.wire.pull import idle_turn_bound_s
from hsx.wire.worker import JobEnd, JobWatch, heartbeats, job_session, until_done, watching, worker_exit_code

log = structlog.get_logger("hsx.uploader")


async def run(cfg: UploaderConfig) -> int:
    # Live while a turn of its loop keeps within the bound of one with nothing in hand: uploads
    # run on tasks of their own, never inside a turn.
    health = Health(turn_bound_s=lambda: idle_turn_bound_s(cfg.idle_fetch_timeout_s))
    with serving(health, cfg.health_listen):
        return await _run(cfg, health)


async def _run(cfg: UploaderConfig, health: Health) -> int:
    make_private_dirs(cfg.spool)
    async with job_session(
        cfg.nats, cfg.job, name=f"hsx-upload-{cfg.job}-{cfg.instance}", wait_s=cfg.wait_for_job_s, uploader=cfg.instance
    ) as session:
        if session is None:
            return STOPPED  # a signal came before the job's spec
        js, spec, stopping = session.js, session.spec, session.stopping
        health.watch_stop(stopping)
        dest = open_destination(spec_location(spec.dest), max_connections=cfg.max_inflight)
        events = EventPublisher(session.nc, js, cfg.job)
        watch = JobWatch(session.kv, spec, stopping)
        await asyncio.to_thread(remove_stale_plans, cfg.spool, spec)
        durable = await topology.ensure_upload_consumer(js, cfg.job, cfg.node, ack_wait_s=cfg.ack_wait_s)
        sub = await js.pull_subscribe_bind(durable=durable, stream=topology.FILES_STREAM)
        mover = FileMover(cfg, dest, events, spec, watch=watch)
        stopping.in_hand = lambda: {"uploads_in_hand": mover.inflight}
        end = JobEnd(js, watch, stopping, settled=lambda: mover.inflight == 0) if cfg.until_done else None
        health.ready()  # bound to its durable
        log.info(
            "uploader_ready",
            dest=dest.url,
            node=cfg.node,
            durable=durable,
            max_inflight=cfg.max_inflight,
            until_done=cfg.until_done,
        )
        async with watching(watch):
            try:
                async with (
                    heartbeats(events, cfg, service=SERVICE, stopping=stopping, state=mover.heartbeat_state),
                    until_done(end),
                ):
                    await pull_loop(mover, sub, cfg, stopping, health)
            finally:
                mover.close()
                await sub.unsubscribe()
                if watch.lost:
                    folder = plan_folder(cfg.spool, spec.job, spec.plan_tag)
                    await asyncio.to_thread(remove_plan_folder, folder, reason="the job was lost")
        if end is not None and end.verdict == "done":
            # Every sample is in the destination: a file of the job still in the spool is a stray
            # copy (a later write's, whose event was settled), never a sample left to upload.
            files, used = await asyncio.to_thread(spool_usage, cfg.spool, spec.job, spec.plan_tag)
            if files:
                log.warning("spool_files_left", files=files, bytes=used, spool=str(cfg.spool), reason="job done")
        log.info("uploader_stopped", **({"verdict": end.verdict} if end is not None and end.verdict else {}))
        return worker_exit_code(end)
