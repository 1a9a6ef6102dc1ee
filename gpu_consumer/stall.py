"""When a batch's work counts as stalled, and what the consumer says about one.

A forward runs on a worker thread and cannot be interrupted: a wedged device, a deadlocked
kernel or a driver hang leaves it running for good, while the consumer's `in_progress()` keeps
its batch away from every other consumer. So can a spool write or fsync on a dead disk or a hung
network file system, and the announcements and ack that follow. The consumer therefore measures
its own pace (seconds per padded token, from the forwards it finished) and gives each forward a
bound derived from its batch's size: `stall_factor` x the time the batch should take, never less
than `stall_after_s`; a write attempt and the announcing get `stall_after_s`. Past its bound the
stage is *stalled*: the consumer stops vouching for the batch (JetStream hands it to another
consumer after the ack wait) and says so in its heartbeat.

Knows nothing of NATS or threads: the pull loop and BatchWorker do the releasing.
"""

import time
from dataclasses import dataclass
from typing import NamedTuple

from hsx.wire.schemas import BatchDescriptor


class ReleasedBatch(Exception):
    """A stalled stage failed, or ended after its batch was settled elsewhere (done by another
    consumer, or dead-lettered by the exhausted-batch reaper), after the batch was released: it
    belongs to whoever holds it now, so nothing more is written, announced, nak'ed or
    dead-lettered from here."""


class Stage(NamedTuple):
    name: str  # as the heartbeat's detail says it
    stalled: str  # the log event when it stalls
    finished: str  # the log event when a stalled one ends after all


# The stages of a batch that are watched.
STAGES = {
    "forward": Stage("forward", "forward_stalled", "stalled_forward_finished"),
    "write": Stage("spool write", "write_stalled", "stalled_write_finished"),
    "announce": Stage("announcing", "announce_stalled", "stalled_announce_finished"),
}


@dataclass(frozen=True, kw_only=True)
class Stall:
    batch_id: str
    began: float  # time.monotonic() when the stage started
    bound_s: float
    stage: str = "forward"  # one of STAGES

    def running_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.began


class ForwardPace:
    """Seconds per padded token of this consumer's recent forwards, and the stall bound of a batch.

    An exponential average, so one slow batch (a recompile for a new shape, a split on OOM) moves
    it only a little. A forward that stalled is not measured: counting it would raise every later
    bound by the time the device spent hung."""

    def __init__(self, *, stall_after_s: float, stall_factor: float, smoothing: float = 0.2) -> None:
        self.stall_after_s = stall_after_s
        self.stall_factor = stall_factor
        self.smoothing = smoothing
        self.s_per_token: float | None = None  # None until a forward has finished

    @staticmethod
    def padded_tokens(batch: BatchDescriptor) -> int:
        return max(1, len(batch.samples) * batch.padded_len)

    def add(self, batch: BatchDescriptor, seconds: float) -> None:
        rate = seconds / self.padded_tokens(batch)
        self.s_per_token = (
            rate if self.s_per_token is None else ((1 - self.smoothing) * self.s_per_token + self.smoothing * rate)
        )

    def bound_s(self, batch: BatchDescriptor) -> float:
        """Seconds a forward of `batch` may run before it counts as stalled. Before anything was
        measured only the floor applies (it must cover a first forward's compiling and tuning)."""
        return self.bound_for_tokens(self.padded_tokens(batch))

    def bound_for_tokens(self, padded_tokens: int) -> float:
        """`bound_s` of a batch of `padded_tokens` (a job's largest: its token budget)."""
        if self.s_per_token is None:
            return self.stall_after_s
        return max(self.stall_after_s, self.stall_factor * self.s_per_token * padded_tokens)
