"""What a worker measures of its own pace for its heartbeat's `load` (schemas.WorkerLoad): how
many samples it finished over its last minute (`RecentRate`), the share of wall time one stage of
its loop was running (`BusyMeter`), and the free bytes of its spool's file system.

Counters only: they know nothing of batches, uploads or NATS. The event loop calls `add` and
`enter`/`leave`; the heartbeat's thread reads them (plain floats and ints, read whole).
"""

import collections
import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

# The window a worker's samples/s is taken over.
RATE_WINDOW_S = 60.0


class RecentRate:
    """Samples finished per second over the last `window_s` (or since the first one, when that
    is more recent); 0 before any."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._started = time.monotonic()
        self._done: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, samples: int, now: float | None = None) -> None:
        self._done.append((time.monotonic() if now is None else now, samples))

    def per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._done and now - self._done[0][0] > self.window_s:
            self._done.popleft()
        span = min(self.window_s, now - self._started)
        return sum(n for _, n in list(self._done)) / span if span > 0 else 0.0


class BusyMeter:
    """The share of wall time at least one `running()` block was open, between two `share()`
    readings. Overlapping blocks (a forward queued while the last one's copy lands) count once."""

    def __init__(self) -> None:
        self._open = 0
        self._since = 0.0  # when the first of the open blocks began
        self._total = 0.0  # seconds with a block open, closed blocks only
        self._read_at = time.monotonic()
        self._read_total = 0.0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        if self._open == 0:
            self._since = time.monotonic()
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            if self._open == 0:
                self._total += time.monotonic() - self._since

    def share(self) -> float:
        """0..1: the busy share since the previous reading (since the meter began, at the first)."""
        now = time.monotonic()
        total = self._total + (now - self._since if self._open else 0.0)
        span = now - self._read_at
        busy = total - self._read_total
        self._read_at, self._read_total = now, total
        return min(1.0, max(0.0, busy / span)) if span > 0 else 0.0


def spool_free(spool: Path) -> int:
    """Free bytes of the file system the spool is on; -1 when it cannot be read."""
    try:
        return shutil.disk_usage(spool).free
    except OSError:
        return -1
