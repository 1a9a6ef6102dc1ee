"""Rates and ETA from a sliding window of (time, count) readings."""

import collections
import time


class RateWindow:
    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.points: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, value: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.points.append((now, value))
        while len(self.points) > 2 and now - self.points[0][0] > self.window_s:
            self.points.popleft()

    def per_second(self) -> float:
        if len(self.points) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


def eta_seconds(remaining: int, rate: float) -> float | None:
    if remaining <= 0:
        return 0.0
    return remaining / rate if rate > 0 else None
