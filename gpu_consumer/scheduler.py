"""The GPU consumer's scheduler: what it fetches, starts, overlaps, holds and hands back.

Two batches overlap: batch N is written, announced and acked (`BatchWorker.finish`) while batch
N+1's forward runs (`BatchWorker.compute`); N+2's forward starts only once N is finished. The next
descriptor is fetched while the current one computes, unless the spool is near its high-water
mark or the current batch is a redelivery (it runs alone). Paused at the mark, or stuck behind a
stalled stage, it holds no batch it has not started: those are handed back (`give_back`). The
loop itself is the workers' shared one (hsx.wire.pull.PullLoop).
"""

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from nats.js import JetStreamContext

from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.extract import DeviceFailed
from hsx.gpu_consumer.service import BatchWorker, Computed
from hsx.wire.jetstream import give_back
from hsx.wire.natsconn import NATS_OUTAGE_ERRORS
from hsx.wire.pull import PullLoop, Taken

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


async def _hand_back(js: JetStreamContext, taken: Taken, *, why: str) -> None:
    """Give a message this consumer will not start back to the queue (`give_back`); its next
    delivery counts as one: JetStream has no way to return a message uncounted."""
    taken.release()
    try:
        await give_back(js, taken.msg)
    except Exception as exc:  # NATS gone: the ack wait hands it back instead
        log.warning("batch_not_returned", why=why, error=str(exc) or type(exc).__name__)
    else:
        log.info("batch_handed_back", why=why, seq=taken.msg.metadata.sequence.stream)


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


class BatchScheduler(PullLoop[Taken]):
    """The consumer's policy in the shared pull loop: one descriptor at a time, fetched ahead while
    the current batch computes; a pause at the spool's high-water mark; nothing fetched while the
    batch being finished is stalled."""

    def __init__(self, worker: BatchWorker, sub, cfg: ConsumerConfig, stopping: asyncio.Event) -> None:
        super().__init__(sub, stopping=stopping, watch=worker.watch, fetch_timeout_s=cfg.idle_fetch_timeout_s)
        self.worker = worker
        self.cfg = cfg
        self.finishing: asyncio.Task | None = None
        # The next descriptor is fetched while the current batch computes, so the GPU does not
        # wait for a round trip to NATS between batches.
        self.prefetch: asyncio.Task | None = None
        self.paused = False
        self.used = 0  # the spool's bytes, as last looked at (`room`)

    async def _settle_finishing(self) -> None:
        await _settle(self.finishing)
        self.finishing = None

    def _finishing_runs(self) -> bool:
        return self.finishing is not None and not self.finishing.done()

    async def release_ahead(self) -> None:
        held, self.prefetch = self.prefetch, None
        await _return_unstarted(held, self.worker.js)

    async def finished_first(self, taken: Taken, computed: Computed | None = None) -> bool:
        """Wait for the batch being finished before going on with `taken`. Should that batch stall
        meanwhile (a hung write), what this loop holds is handed back rather than held, kept
        alive, for as long as the stall lasts: False."""
        while self._finishing_runs():
            if self.worker.stall is not None:
                await self.release_ahead()
                if computed is not None and computed.lease is not None:
                    computed.lease.release()  # its forward is done: no thread writes into it
                await _hand_back(self.worker.js, taken, why="the batch before it stalled")
                return False
            await asyncio.wait({self.finishing}, timeout=0.5)
        await self._settle_finishing()
        return True

    async def room(self) -> int:
        worker, cfg = self.worker, self.cfg
        if self._finishing_runs() and worker.stall is not None:
            # The batch being written or announced is stalled: a batch fetched now could only be
            # handed back (a delivery spent for nothing) until it ends.
            await asyncio.wait({self.finishing}, timeout=1.0)
            return 0
        full, used = worker.spool_full()
        if not full and self._finishing_runs() and not worker.room_for(used, 1):
            # The batch being written may take the spool past the mark: let it land before
            # fetching one that could then not be started.
            await self._settle_finishing()
            full, used = worker.spool_full()
        if full:
            if self.prefetch is not None:
                # Kept, it would wait here with in_progress for as long as the pause lasts.
                await self.release_ahead()
            if not self.paused:
                log.warning("spool_high_water_paused", spool_bytes=used, high_water=cfg.spool_high_water_bytes)
                self.paused = True
            worker.state = "paused"
            worker.detail = f"spool holds {used} bytes, high-water mark {cfg.spool_high_water_bytes}"
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=2.0)
            except TimeoutError:
                pass
            return 0
        if self.paused:
            log.info("spool_resumed", spool_bytes=used)
            self.paused = False
            worker.state, worker.detail = "idle", ""
        self.used = used
        return 1

    async def _take(self) -> Taken:
        """One descriptor from the queue, kept in progress from now on (TimeoutError: none came)."""
        msgs = await self.fetch(1)
        return Taken.of(msgs[0], interval_s=self.cfg.in_progress_s)

    async def next(self, count: int) -> Taken:
        fetching, self.prefetch = self.prefetch or asyncio.create_task(self._take()), None
        return await fetching

    async def idle(self) -> None:
        await self._settle_finishing()  # idle: nothing to overlap with
        if self.worker.state == "working":
            self.worker.state = "idle"

    async def take(self, taken: Taken) -> None:
        worker = self.worker
        if taken.msg.metadata.num_delivered > 1:
            # A redelivered batch may be what killed its last consumer: it runs alone (the batch
            # before it finished first, nothing fetched ahead), so that dying on it again costs no
            # other batch one of its deliveries.
            if not await self.finished_first(taken):
                return
        elif not self.stopping.is_set() and worker.room_for(self.used, 2):
            # Only what can be started: near the high-water mark (this batch and the one being
            # written still to land), a descriptor fetched ahead would be held through the pause
            # that follows.
            self.prefetch = asyncio.create_task(self._take())
        try:
            computed = await worker.compute(taken, on_stall=self.release_ahead)
        except DeviceFailed:
            raise  # the consumer ends (its wind-down hands back what was fetched ahead)
        except Exception as exc:
            log.warning("batch_interrupted", error=f"{type(exc).__name__}: {exc}", exc_info=True)
            return
        # Batch N must be finished before batch N+1's finish starts (and before batch N+2's
        # forward leases staging buffers: two batches leased at most); batch N+1's forward has
        # just run alongside it.
        if computed is None:
            await self._settle_finishing()
        elif await self.finished_first(computed.taken, computed):
            self.finishing = asyncio.create_task(_finish_guarded(worker, computed, self.release_ahead))

    async def wind_down(self) -> None:
        await _return_unstarted(self.prefetch, self.worker.js)
        await _settle(self.finishing)


async def pull_loop(worker: BatchWorker, sub, cfg: ConsumerConfig, stopping: asyncio.Event) -> None:
    await BatchScheduler(worker, sub, cfg, stopping).run()
