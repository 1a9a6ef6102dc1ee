"""The GPU consumer's settings, built and validated once by the CLI. What to extract (model,
layers, dtype, destination) is not here: it comes from the job spec the producer recorded."""

from dataclasses import dataclass
from pathlib import Path

from hsx.natsconn import NatsSettings


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    nats: NatsSettings
    job: str
    device: str
    spool: Path
    node: str
    instance: str
    spool_high_water_bytes: int
    # How long a batch may go without a sign of life before JetStream redelivers it. Shared by
    # every consumer of the job (the durable holds it); in_progress() is sent well inside it.
    ack_wait_s: float = 60.0
    # A failing batch is retried after retry_delay_s x its delivery number.
    retry_delay_s: float = 2.0
    # Sample files are serialised, hashed and written on this many threads (safetensors, hashlib
    # and file writes release the GIL).
    writer_threads: int = 8
    # torch.compile each decoder layer (fuses the element-wise work between the matmuls): 1.36x the
    # forward on an H200 for a Qwen3-8B shape, for ~20 s of compiling at start (docs/PERFORMANCE.md).
    compile_layers: bool = False
    # A forward running longer than stall_factor x what its batch should take at this consumer's
    # measured pace, and never less than stall_after_s, is stalled: its batch is released to
    # another consumer and the heartbeat says `stalled` (gpu_consumer/stall.py). The floor covers
    # a first forward's compiling; a real device hang lasts far longer.
    stall_after_s: float = 300.0
    stall_factor: float = 10.0
    heartbeat_s: float = 5.0
    idle_fetch_timeout_s: float = 1.0
    stop_deadline_s: float = 120.0

    @property
    def in_progress_s(self) -> float:
        return max(0.5, min(10.0, self.ack_wait_s / 3))
