"""The producer's settings, built and validated once by the CLI."""

from dataclasses import dataclass
from pathlib import Path

from hsx.wire.natsconn import NatsSettings
from hsx.wire.schemas import LayerSelector

# What to do with a sample longer than max_seq_len (producer/lengths.py).
ON_LONG = ("error", "truncate", "skip")


@dataclass(frozen=True, kw_only=True)
class ProducerConfig:
    nats: NatsSettings
    job: str
    model: str
    dataset: Path
    layers: tuple[LayerSelector, ...]  # as given: resolved against the model by the producer
    dest: str
    dtype: str
    token_budget: int
    max_seq_len: int
    max_batch_size: int | None = None
    on_long: str = "error"  # one of ON_LONG
    trust_remote_code: bool = False
    # Servers of a JetStream cluster holding each hsx stream and bucket; None keeps what exists
    # (R1 when creating). docs/OPERATIONS.md, Multi-node.
    replicas: int | None = None
