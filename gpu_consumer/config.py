"""The GPU consumer's settings, built and validated once by the CLI. What to extract (model,
layers, dtype, destination) is not here: it comes from the job spec the producer recorded."""

from dataclasses import dataclass

from hsx.wire.worker import WorkerConfig


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig(WorkerConfig):
    device: str
    spool_high_water_bytes: int
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
