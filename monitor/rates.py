"""Rates and ETA from a series of (time, count) readings.

A job's counts grow in bursts (a batch's samples are written, then uploaded, together), so a rate
over the last window alone swings with how many bursts the window happens to hold: the ETA went
from 2 to 7 minutes within one batch. `RateWindow.per_second` is instead an exponential average of
the rate with time constant `window_s`, corrected for its start (until `window_s` has passed, it
is the average since the first reading, not an average pulled toward zero): the count gained
over the time taken, each interval weighed by exp(-age / window_s). A burst moves it by about the
burst's share of the window, and a stop lets it decay rather than drop to zero at once. When the
bursts come further apart than a sixth of the window (batches of minutes each), the window
widens to six of their usual gaps, so that it always holds several.
"""

import math
import time


class RateWindow:
    def __init__(self, window_s: float = 120.0) -> None:
        self.window_s = window_s
        self._last: tuple[float, int] | None = None
        self._gained = 0.0  # the count gained over the readings, each interval weighed by its age
        self._taken = 0.0  # the seconds they took, weighed alike
        self._last_rise: float | None = None  # when the count last grew
        self._gap = 0.0  # the usual seconds between two rises (an exponential average)

    def add(self, value: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is not None:
            t0, v0 = self._last
            dt = now - t0
            if dt <= 0:
                return
            if value > v0:
                if self._last_rise is not None:
                    gap = now - self._last_rise
                    self._gap = gap if not self._gap else 0.7 * self._gap + 0.3 * gap
                self._last_rise = now
            keep = math.exp(-dt / max(self.window_s, 6 * self._gap))
            self._gained = self._gained * keep + (value - v0)
            self._taken = self._taken * keep + dt
        self._last = (now, value)

    def per_second(self) -> float:
        return self._gained / self._taken if self._taken > 0 else 0.0


def eta_seconds(remaining: int, rate: float) -> float | None:
    if remaining <= 0:
        return 0.0
    return remaining / rate if rate > 0 else None
