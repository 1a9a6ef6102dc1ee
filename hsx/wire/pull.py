"""The pull loop of a spooling worker (the consumer's batches, the uploader's file events), written
once: `PullLoop` owns the loop, the service supplies what it does with what it fetched.

While not stopping: the service says how many messages it can take now (`room`, which waits when
it has none), they are fetched with a short timeout (none came: `idle`) and handed to the
service (`take`); a failed fetch is logged, the job checked (`JobWatch`) and tried again a second
later. An in-flight fetch is never cancelled to stop. However the loop ends, `wind_down` deals
with what is in hand. Each turn ticks the worker's `Health` (hsx/wire/health.py), if it has one;
`idle_turn_bound_s` is how long a turn takes at most with nothing in hand. `Taken` is a message
kept in progress from its fetch until it is settled.
"""

import asyncio
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

from nats.aio.msg import Msg

from hsx.logs import get_logger
from hsx.wire import denials
from hsx.wire.events import keep_in_progress
from hsx.wire.health import Health
from hsx.wire.worker import JobWatch

log = get_logger("hsx.pull")

T = TypeVar("T")

# How long the loop waits after a failed fetch before it fetches again.
_FETCH_RETRY_S = 1.0
# A JetStream API request's timeout (nats-py's): the read of the job's spec after a failed fetch.
_REQUEST_S = 5.0


def idle_turn_bound_s(fetch_timeout_s: float) -> float:
    """The longest turn of the loop with nothing in hand: a wait for room (up to a fetch timeout),
    a fetch (one more), its failure's check of the job's spec and the pause before the next, and
    a fetch timeout to spare."""
    return 3 * fetch_timeout_s + _REQUEST_S + _FETCH_RETRY_S


@dataclass
class Taken:
    """A message taken from the queue. `in_progress` runs from its fetch until it is settled
    (acked, nak'ed, terminated, dead-lettered, handed back) or released (a stalled batch), so a
    message held anywhere in a worker (a descriptor fetched ahead, a redelivery waiting for the
    batch before it, a batch whose files wait for a full disk, an upload waiting out an outage) is
    never handed to another worker."""

    msg: Msg
    keep_alive: asyncio.Task

    @classmethod
    def of(cls, msg: Msg, *, interval_s: float) -> "Taken":
        """`msg`, kept in progress every `interval_s` from now on (call inside the running loop)."""
        return cls(msg, asyncio.create_task(keep_in_progress(msg, interval_s=interval_s)))

    def release(self) -> None:
        """Stop vouching for the message: settled, or given up to JetStream's redelivery."""
        self.keep_alive.cancel()

    def renew(self, *, interval_s: float) -> None:
        """Vouch for it again (a stalled stage that ended while the batch was still queued)."""
        self.keep_alive.cancel()
        self.keep_alive = asyncio.create_task(keep_in_progress(self.msg, interval_s=interval_s))


class PullLoop(Generic[T]):
    """The loop; a service subclasses it and supplies `take` (and `room`, `next`, `idle`,
    `wind_down` where its policy needs them). `T` is what `next` hands to `take`: by default the
    fetched messages."""

    def __init__(
        self,
        sub,
        *,
        stopping: asyncio.Event,
        watch: JobWatch | None,
        fetch_timeout_s: float,
        health: Health | None = None,
    ) -> None:
        self.sub = sub
        self.stopping = stopping
        self.health = health
        # Whether the job is still the one the worker started for (None: not watched, in tests).
        self.watch = watch
        self.fetch_timeout_s = fetch_timeout_s

    async def run(self) -> None:
        started = time.monotonic()
        try:
            while not self.stopping.is_set():
                if self.health is not None:
                    self.health.tick()
                count = await self.room()
                if not count:
                    continue
                try:
                    got = await self.next(count)
                except TimeoutError:
                    # A fetch this user may not make looks like an idle queue: say so and stop.
                    denials.raise_if_denied(started, what="a fetch from the durable", about="msg.next")
                    await self.idle()
                    continue
                except Exception as exc:  # NATS reconnecting, or the durable gone with its job
                    log.warning("fetch_failed", error=str(exc) or type(exc).__name__)
                    if self.watch is not None:
                        await self.watch.check()
                    await asyncio.sleep(_FETCH_RETRY_S)
                    continue
                await self.take(got)
        finally:
            await self.wind_down()

    async def fetch(self, count: int) -> list[Msg]:
        """Up to `count` messages, waiting at most the fetch timeout (TimeoutError: none came)."""
        msgs = await self.sub.fetch(count, timeout=self.fetch_timeout_s)
        if not msgs:
            raise TimeoutError
        return msgs

    async def room(self) -> int:
        """How many messages to fetch now; 0 after waiting a while: ask again (unless stopping)."""
        return 1

    async def next(self, count: int) -> T:
        """What the loop hands to `take` next: by default `count` messages fetched now."""
        return await self.fetch(count)  # type: ignore[return-value]

    async def take(self, got: T) -> None:
        """The service's handler: start (or do) the work of what was fetched."""
        raise NotImplementedError

    async def idle(self) -> None:
        """Nothing came within the fetch timeout."""

    async def wind_down(self) -> None:
        """The loop has ended (stopping, or an error): finish or hand back what is in hand."""
