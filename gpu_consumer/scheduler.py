"""The GPU consumer's scheduler: what it fetches, starts, overlaps, holds and hands back.

Two batches overlap: batch N is written, announced and acked (`BatchWorker.finish`) while batch
N+1's forward runs (`BatchWorker.compute`); N+2's forward starts only once N is finished. The next
descriptor is fetched while the current one computes, unless the spool is near its high-water
mark or the current batch is a redelivery (it runs alone). Paused at the mark, or stuck behind a
stalled stage, it holds no batch it has not started: those are handed back (`give_back`).
"""

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from nats.js import JetStreamContext

from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.service import BatchWorker, Computed, Taken
from hsx.wire.jetstream import give_back
from hsx.wire.natsconn import NATS_OUTAGE_ERRORS

log = structlog.get_logger("hsx.gpu_consumer")


async def _finish_guarded(
    worker: BatchWorker, computed: Computed, on_stall: Callable[[], Awaitable[None]] | None
) -> None:
    try:
        await worker.finish(computed, on_stall=on_stall)
    except NATS_OUTAGE_ERRORS as exc:
        # NATS away while announcing or acking (past the outage budget, or stopping): the batch
        # stays unacked and is redelivered after the ack wait (its files are rewritten identically).
        log.warning(
            "batch_left_unacked",
            batch=computed.batch.batch_id,
            error=f"{type(exc).__name__}: {exc}",
            redelivered_after_s=worker.cfg.ack_wait_s,
        )
    except Exception as exc:  # a bug: its traceback
        log.warning(
            "batch_interrupted", batch=computed.batch.batch_id, error=f"{type(exc).__name__}: {exc}", exc_info=True
        )


async def _settle(task: asyncio.Task | None) -> None:
    if task is not None:
        await task


async def _take(sub, cfg: ConsumerConfig) -> Taken:
    """One descriptor from the queue, kept in progress from now on (TimeoutError: none came)."""
    msgs = await sub.fetch(1, timeout=cfg.idle_fetch_timeout_s)
    if not msgs:
        raise TimeoutError
    return Taken.of(msgs[0], interval_s=cfg.in_progress_s)


async def _hand_back(js: JetStreamContext, taken: Taken, *, why: str) -> None:
    """Give a message this consumer will not start back to the queue (`give_back`); its next
    delivery counts as one: JetStream has no way to return a message uncounted."""
    taken.release()
    try:
        await give_back(js, taken.msg)
    except Exception as exc:  # NATS gone: the ack wait hands it back instead
        log.warning("batch_not_returned", why=why, error=str(exc) or type(exc).__name__)


async def _return_unstarted(prefetch: asyncio.Task | None, js: JetStreamContext) -> None:
    """Hand back a descriptor fetched ahead but never started (we are stopping, paused at the
    high-water mark, or stuck in a stalled batch): it goes to another consumer at once instead of
    waiting here, kept alive, for as long as that lasts."""
    if prefetch is None:
        return
    try:
        taken = await prefetch
    except Exception:
        return
    await _hand_back(js, taken, why="fetched ahead, not started")


async def pull_loop(worker: BatchWorker, sub, cfg: ConsumerConfig, stopping: asyncio.Event) -> None:
    finishing: asyncio.Task | None = None
    # The next descriptor is fetched while the current batch computes, so the GPU does not wait
    # for a round trip to NATS between batches.
    prefetch: asyncio.Task | None = None
    paused = False

    async def release_ahead() -> None:
        nonlocal prefetch
        held, prefetch = prefetch, None
        await _return_unstarted(held, worker.js)

    async def finished_first(taken: Taken, computed: Computed | None = None) -> bool:
        """Wait for the batch being finished before going on with `taken`. Should that batch stall
        meanwhile (a hung write), what this loop holds is handed back rather than held, kept
        alive, for as long as the stall lasts: False."""
        nonlocal finishing
        while finishing is not None and not finishing.done():
            if worker.stall is not None:
                await release_ahead()
                if computed is not None and computed.lease is not None:
                    computed.lease.release()  # its forward is done: no thread writes into it
                await _hand_back(worker.js, taken, why="the batch before it stalled")
                return False
            await asyncio.wait({finishing}, timeout=0.5)
        await _settle(finishing)
        finishing = None
        return True

    try:
        while not stopping.is_set():
            if finishing is not None and not finishing.done() and worker.stall is not None:
                # The batch being written or announced is stalled: a batch fetched now could only
                # be handed back (a delivery spent for nothing) until it ends.
                await asyncio.wait({finishing}, timeout=1.0)
                continue
            full, used = worker.spool_full()
            if not full and finishing is not None and not finishing.done() and not worker.room_for(used, 1):
                # The batch being written may take the spool past the mark: let it land before
                # fetching one that could then not be started.
                await _settle(finishing)
                finishing = None
                full, used = worker.spool_full()
            if full:
                if prefetch is not None:
                    # Kept, it would wait here with in_progress for as long as the pause lasts.
                    await release_ahead()
                if not paused:
                    log.warning("spool_high_water_paused", spool_bytes=used, high_water=cfg.spool_high_water_bytes)
                    paused = True
                worker.state = "paused"
                worker.detail = f"spool holds {used} bytes, high-water mark {cfg.spool_high_water_bytes}"
                try:
                    await asyncio.wait_for(stopping.wait(), timeout=2.0)
                except TimeoutError:
                    pass
                continue
            if paused:
                log.info("spool_resumed", spool_bytes=used)
                paused = False
                worker.state, worker.detail = "idle", ""
            fetching, prefetch = prefetch or asyncio.create_task(_take(sub, cfg)), None
            try:
                taken = await fetching
            except TimeoutError:
                await _settle(finishing)  # idle: nothing to overlap with
                finishing = None
                if worker.state == "working":
                    worker.state = "idle"
                continue
            except Exception as exc:  # NATS reconnecting, or the durable gone with its job
                log.warning("fetch_failed", error=str(exc) or type(exc).__name__)
                if worker.watch is not None:
                    await worker.watch.check()
                await asyncio.sleep(1.0)
                continue
            if taken.msg.metadata.num_delivered > 1:
                # A redelivered batch may be what killed its last consumer: it runs alone (the
                # batch before it finished first, nothing fetched ahead), so that dying on it
                # again costs no other batch one of its deliveries.
                if not await finished_first(taken):
                    continue
            elif not stopping.is_set() and worker.room_for(used, 2):
                # Only what can be started: near the high-water mark (this batch and the one
                # being written still to land), a descriptor fetched ahead would be held
                # through the pause that follows.
                prefetch = asyncio.create_task(_take(sub, cfg))
            try:
                computed = await worker.compute(taken, on_stall=release_ahead)
            except Exception as exc:
                log.warning("batch_interrupted", error=f"{type(exc).__name__}: {exc}", exc_info=True)
                continue
            # Batch N must be finished before batch N+1's finish starts (and before batch N+2's
            # forward leases staging buffers: two batches leased at most); batch N+1's forward
            # has just run alongside it.
            if computed is None:
                await _settle(finishing)
                finishing = None
            elif await finished_first(computed.taken, computed):
                finishing = asyncio.create_task(_finish_guarded(worker, computed, release_ahead))
    finally:
        await _return_unstarted(prefetch, worker.js)
        await _settle(finishing)
