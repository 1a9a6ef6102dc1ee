"""How long a GPU consumer takes at most from its first SIGTERM (or SIGINT) to its exit: the
grace period a batch scheduler should give it (Slurm's `--signal=B:TERM@N`, Kubernetes'
`terminationGracePeriodSeconds`), from its settings (`stop_bound_s`); and how long one turn of
its pull loop may take while it works (`turn_bound_s`, past which /livez says it is not live).
The docs state this arithmetic and the tests check against it; nothing here is measured.

After the signal the consumer takes no new batch and finishes those in hand (at most DEPTH).
Each stage of a batch is watched with its bound (gpu_consumer/stall.py): its forward, at least
--stall-after or 10x what the batch should take at the consumer's measured pace; its write and
its announcing, --stall-after each; then its ack. A stage past its bound is stalled, and while
stopping it is abandoned, not waited out (its batch, released, is redelivered after --ack-wait),
so each stage ends within its bound. Then the exhausted-batch reaper gets REAPER_STOP_S, the
goodbye heartbeat LAST_WORDS_S, and the connection's drain DRAIN_TIMEOUT_S (milliseconds with a
server that answers). A turn of the loop waits at most for a fetch and for the batches in hand,
each within the same stage bounds. Knows no process or signal.
"""

from hsx.gpu_consumer.config import ConsumerConfig
from hsx.gpu_consumer.scheduler import DEPTH
from hsx.wire.lifecycle import LAST_WORDS_S
from hsx.wire.natsconn import DRAIN_TIMEOUT_S
from hsx.wire.pull import idle_turn_bound_s

# How long a stopping consumer waits for its exhausted-batch reaper (gpu_consumer/main.py).
REAPER_STOP_S = 5.0
# A batch's ack (nats-py's ack_sync timeout).
ACK_S = 1.0


def _per_batch_s(cfg: ConsumerConfig, forward_bound_s: float | None) -> float:
    forward = cfg.stall_after_s if forward_bound_s is None else max(cfg.stall_after_s, forward_bound_s)
    return forward + 2 * cfg.stall_after_s + ACK_S


def stop_bound_s(cfg: ConsumerConfig, *, forward_bound_s: float | None = None) -> float:
    """Seconds from the first signal to the exit at most, with NATS answering. `forward_bound_s`:
    the longest forward bound of a batch in hand (ForwardPace.bound_s); None: --stall-after,
    the bound before anything was measured and for any batch at the measured pace that keeps
    within it."""
    per_batch = _per_batch_s(cfg, forward_bound_s)
    return cfg.idle_fetch_timeout_s + DEPTH * per_batch + REAPER_STOP_S + LAST_WORDS_S + DRAIN_TIMEOUT_S


def turn_bound_s(cfg: ConsumerConfig, *, forward_bound_s: float | None = None) -> float:
    """Seconds one turn of the consumer's pull loop may take: a turn with nothing in hand
    (hsx/wire/pull.py) and the batches in hand (`forward_bound_s` as for `stop_bound_s`)."""
    return idle_turn_bound_s(cfg.idle_fetch_timeout_s) + DEPTH * _per_batch_s(cfg, forward_bound_s)
