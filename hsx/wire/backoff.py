"""Retry delays with jitter.

Uploads that fail together (a hundred in flight when an endpoint goes away) must not retry
together: in lockstep they hit the endpoint as one burst per step, and a recovering endpoint sees
the burst first. `retry_delay` is exponential backoff with full jitter (each delay drawn evenly
between 0 and the step's ceiling); `jittered` spreads a fixed interval (the uploader's probe of a
refusing destination). This module knows nothing about what is being retried.
"""

import random

_rng = random.Random()


def retry_delay(attempt: int, *, base_s: float, cap_s: float, rng: random.Random = _rng) -> float:
    """Seconds to wait before retry number `attempt` (0 for the first): uniform in
    [0, min(cap_s, base_s * 2**attempt)]."""
    ceiling = min(cap_s, base_s * 2 ** min(attempt, 32))
    return rng.uniform(0.0, ceiling)


def jittered(seconds: float, *, spread: float = 0.25, rng: random.Random = _rng) -> float:
    """`seconds` give or take `spread` of it, drawn evenly."""
    return seconds * rng.uniform(1.0 - spread, 1.0 + spread)
