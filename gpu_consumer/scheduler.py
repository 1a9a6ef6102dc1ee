"""The GPU consumer's scheduler: what it fetches, starts, overlaps, holds and hands back.

A pipeline two batches deep on the device: batch N+1's forward is queued on the GPU while batch
N's forward still runs, and batch N's copy to the host runs (on its own stream) under N+1's
forward, then its files are written, announced and acked (`BatchWorker.finish`) while N+1
computes. Each batch is a chain of its own (`_chain`): its first stage (`BatchWorker.start`: the
forward queued, the states landed), then, once every batch before it is finished, its finish; so
batches are finished, and acked, in the order they were taken. The next batch is taken once this
one's forward is queued (`Running.launched`), and at most `DEPTH` batches are in hand at once:
one being written, one landing, one queued behind it. Each holds its states in host buffers
leased to it (gpu_consumer/staging.py): at most `DEPTH` batches' states are leased at once; on the
device, the states of the batch being copied out and those of the batch computing (the caching
allocator gives a copied batch's memory back once its copy is done).

The next descriptor is fetched while the current one computes, unless the spool is near its
high-water mark or the current batch is a redelivery (it runs alone: everything before it
finished first, nothing fetched ahead, nothing taken after it until its forward is done). Paused
at the mark, or stuck behind a stalled stage, it holds no batch it has not started: those are
handed back (`give_back`). The loop itself is the workers' shared one (hsx.wire.pull.PullLoop).
"""

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from nats.js import JetStreamContext

from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.extract import DeviceFailed
from hsx.gpu_consumer.service import BatchWorker, Computed, Running
from hsx.wire.health import Health
from hsx.wire.jetstream import give_back
from hsx.wire.natsconn import NATS_OUTAGE_ERRORS
from hsx.wire.pull import PullLoop, Taken

log = structlog.get_logger("hsx.gpu_consumer")

# Batches in hand at once: one being written, one whose states are landing, one queued on the
# device behind it. Each holds a staging lease; the spool's room is checked for all of them.
DEPTH = 3


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
    the current batch computes, taken up once the one before it is queued on the device; a pause
    at the spool's high-water mark; nothing fetched while a batch being finished is stalled."""

    def __init__(
        self, worker: BatchWorker, sub, cfg: ConsumerConfig, stopping: asyncio.Event, health: Health | None = None
    ) -> None:
        super().__init__(
            sub, stopping=stopping, watch=worker.watch, fetch_timeout_s=cfg.idle_fetch_timeout_s, health=health
        )
        self.worker = worker
        self.cfg = cfg
        # The batches in hand, in the order taken: each one's chain (first stage, then finish).
        self.chains: list[asyncio.Task] = []
        # The next descriptor is fetched while the current batch computes, so the GPU does not
        # wait for a round trip to NATS between batches.
        self.prefetch: asyncio.Task | None = None
        self.paused = False
        self.used = 0  # the spool's bytes, as last looked at (`room`)
        # The device's failure, met by a batch's first stage: the consumer ends (exit 3).
        self.failure: DeviceFailed | None = None

    def _in_hand(self) -> list[asyncio.Task]:
        self.chains = [chain for chain in self.chains if not chain.done()]
        return self.chains

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def _settle_all(self) -> None:
        """Every batch in hand finished (or settled otherwise)."""
        while self._in_hand():
            await asyncio.wait(set(self.chains))

    async def release_ahead(self) -> None:
        held, self.prefetch = self.prefetch, None
        await _return_unstarted(held, self.worker.js)

    async def _after(self, earlier: list[asyncio.Task], taken: Taken, computed: Computed | None = None) -> bool:
        """Wait for the batches taken before `taken` to be finished. Should one of them stall
        meanwhile in its files or their announcement (a hung write), what this loop holds is
        handed back rather than held, kept alive, for as long as the stall lasts: False. A
        forward stalled behind this batch (a later one's) does not count: `computed` has
        landed, and may go on."""
        pending = [chain for chain in earlier if not chain.done()]
        while pending:
            stall = self.worker.stall
            if stall is not None and (computed is None or stall.stage != "forward"):
                await self.release_ahead()
                if computed is not None and computed.lease is not None:
                    computed.lease.release()  # its forward is done: no thread writes into it
                await _hand_back(self.worker.js, taken, why="the batch before it stalled")
                return False
            await asyncio.wait(pending, timeout=0.5)
            pending = [chain for chain in pending if not chain.done()]
        return True

    async def _chain(self, running: Running, earlier: list[asyncio.Task]) -> None:
        """One batch from its first stage to its ack: its files are finished only once every
        batch taken before it is (acks in order, and at most DEPTH batches' buffers leased)."""
        try:
            computed = await running.task
        except DeviceFailed:
            return  # kept by `_stage_one_done`; the batch is left unacked
        except Exception as exc:
            log.warning("batch_interrupted", error=f"{type(exc).__name__}: {exc}", exc_info=True)
            return
        if computed is None:
            return
        if await self._after(earlier, computed.taken, computed):
            await _finish_guarded(self.worker, computed, self.release_ahead)

    def _stage_one_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and isinstance(task.exception(), DeviceFailed):
            self.failure = self.failure or task.exception()

    async def room(self) -> int:
        self._raise_failure()
        worker, cfg = self.worker, self.cfg
        if self._in_hand() and worker.stall is not None:
            # A batch in hand is stalled: a batch fetched now could only be handed back (a
            # delivery spent for nothing) until it ends.
            await asyncio.wait(set(self.chains), timeout=1.0)
            return 0
        full, used = worker.spool_full()
        in_hand = len(self._in_hand())
        if not full and in_hand and not worker.room_for(used, in_hand):
            # The batches in hand may take the spool past the mark: let them land before
            # fetching one that could then not be started.
            await self._settle_all()
            self._raise_failure()
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
        await self._settle_all()  # idle: nothing to overlap with
        self._raise_failure()
        if self.worker.state == "working":
            self.worker.state = "idle"

    async def take(self, taken: Taken) -> None:
        worker = self.worker
        alone = taken.msg.metadata.num_delivered > 1
        if alone:
            # A redelivered batch may be what killed its last consumer: it runs alone (every
            # batch before it finished, nothing fetched ahead, nothing taken after it before its
            # forward is done), so that dying on it again costs no other batch a delivery.
            if not await self._after(self._in_hand(), taken):
                return
        elif not self.stopping.is_set() and worker.room_for(self.used, len(self._in_hand()) + 2):
            # Only what can be started: near the high-water mark (the batches in hand, this one
            # and the next still to land), a descriptor fetched ahead would be held through the
            # pause that follows.
            self.prefetch = asyncio.create_task(self._take())
        earlier = list(self._in_hand())
        running = worker.start(taken, on_stall=self.release_ahead)
        running.task.add_done_callback(self._stage_one_done)
        self.chains.append(asyncio.create_task(self._chain(running, earlier)))
        # The next batch is taken up once this one's forward is queued behind the one computing:
        # the device's queue is two forwards deep.
        await running.launched.wait()
        if alone:
            await asyncio.wait({running.task})
        while len(self._in_hand()) >= DEPTH:
            await asyncio.wait({self.chains[0]})
        self._raise_failure()

    async def wind_down(self) -> None:
        await _return_unstarted(self.prefetch, self.worker.js)
        await asyncio.gather(*self.chains, return_exceptions=True)


async def pull_loop(
    worker: BatchWorker, sub, cfg: ConsumerConfig, stopping: asyncio.Event, health: Health | None = None
) -> None:
    await BatchScheduler(worker, sub, cfg, stopping, health).run()
