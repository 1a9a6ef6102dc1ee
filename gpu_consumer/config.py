"""The GPU consumer's settings; each flag is declared on its field (hsx/config/fields.py). What to
extract (model, layers, dtype, destination) is not here: it comes from the job spec the producer
recorded."""

from dataclasses import dataclass

from hsx.config.fields import option
from hsx.config.values import positive_float, size_or_auto
from hsx.model.devices import check_consumer_device
from hsx.model.layers import LayerRequest
from hsx.wire.worker import WorkerConfig


@dataclass(frozen=True, kw_only=True)
class ExpectedModel:
    """The model a job will name, known before its spec exists by whoever also runs its producer
    (`hsx up`): the consumer loads it while the producer reads and plans, and keeps it only if the
    spec then names the same model, revision, layers, dtype and remote-code setting."""

    model: str
    layers: LayerRequest  # as given to the producer: resolved against the model's depth as it does
    dtype: str
    trust_remote_code: bool = False
    # > 0: the folder is being made (hsx up's demo model, written whole by a rename): wait up to
    # this many seconds for it to appear before loading.
    made_within_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig(WorkerConfig):
    # "cuda" is made "cuda:0", the first GPU this process sees: under Slurm's --gpus-per-task or
    # Kubernetes' device plugin, the one allocated to it (CUDA_VISIBLE_DEVICES).
    device: str = option(
        "--device",
        default="cuda",
        parse=check_consumer_device,
        env="HSX_DEVICE",
        help="cpu, cuda:N, or cuda: the first GPU this process sees, cuda:0, which under Slurm or Kubernetes is "
        "the one allocated to it (CUDA_VISIBLE_DEVICES); one device (env HSX_DEVICE, default cuda; hsx up's "
        "default is auto: every GPU torch sees, else cpu)",
    )
    # As given ("auto", "200G"), made a byte count by the entry point (commands/services.py):
    # auto is half the spool disk's free space.
    spool_high_water_bytes: int = option(
        "--spool-high-water",
        default="auto",
        parse=size_or_auto("--spool-high-water"),
        env="HSX_SPOOL_HIGH_WATER",
        help="pause fetching when the job's spool holds this many bytes (e.g. 200G; "
        "auto = half the spool disk's free space at start; env HSX_SPOOL_HIGH_WATER)",
    )
    # A failing batch is retried after retry_delay_s x its delivery number.
    retry_delay_s: float = option(
        "--retry-delay",
        default=2.0,
        parse=positive_float("--retry-delay"),
        env="HSX_RETRY_DELAY",
        help="a failing batch is retried after this many seconds x its delivery number "
        "(env HSX_RETRY_DELAY, default 2)",
    )
    # Sample files are serialised, hashed and written on this many threads (safetensors, hashlib
    # and file writes release the GIL).
    writer_threads: int = 8
    # torch.compile each decoder layer (fuses the element-wise work between the matmuls): 1.36x the
    # forward on an H200 for a Qwen3-8B shape, for ~20 s of compiling at start (docs/performance/index.md).
    # None: on with CUDA, off elsewhere (on a CPU compiling costs more than it gains). A compile
    # that fails falls back to eager at the warm-up (gpu_consumer/compiling.py).
    compile_layers: bool | None = option(
        "--compile",
        default=None,
        example=True,
        env="HSX_COMPILE",
        help="torch.compile the decoder layers, on cpu too (default: on with CUDA, off on cpu; a compile "
        "that fails falls back to eager, said in the log and the kernel report; env HSX_COMPILE=1, or 0 for off)",
    )
    no_compile: bool = option(
        "--no-compile",
        default=False,
        env="HSX_NO_COMPILE",
        help="never torch.compile: the eager forward, whatever --compile or HSX_COMPILE say",
    )
    # On a GPU, a hybrid model whose linear-attention layers would run transformers' torch
    # fallback (no fla-core / causal-conv1d) is refused unless allowed (gpu_consumer/kernels.py).
    # On a CPU the torch path is the only one: nothing to refuse.
    allow_slow_kernels: bool = option(
        "--allow-slow-kernels",
        default=False,
        env="HSX_ALLOW_SLOW_KERNELS",
        help="on a GPU, run a hybrid model whose linear attention or causal conv1d would take transformers' "
        "slow torch fallback (fla-core / causal-conv1d missing) instead of refusing to start; one warning "
        "line (env HSX_ALLOW_SLOW_KERNELS=1)",
    )
    # A forward running longer than stall_factor x what its batch should take at this consumer's
    # measured pace, and never less than stall_after_s, is stalled: its batch is released to
    # another consumer and the heartbeat says `stalled` (gpu_consumer/stall.py). The floor covers
    # a first forward's compiling; a real device hang lasts far longer.
    stall_after_s: float = option(
        "--stall-after",
        default=300.0,
        parse=positive_float("--stall-after"),
        env="HSX_STALL_AFTER",
        help="a forward running 10x longer than its batch should take at this consumer's pace, "
        "and at least this many seconds, is stalled: its batch is released to another "
        "consumer and the heartbeat says so (default 300)",
    )
    stall_factor: float = 10.0
    # Set by `hsx up` only (no flag): the model to load before the spec is read (ExpectedModel).
    expected_model: ExpectedModel | None = None

    def compiles(self, device_type: str) -> bool:
        """Whether the decoder layers are torch.compiled on a device of this type."""
        if self.no_compile:
            return False
        if self.compile_layers is not None:
            return self.compile_layers
        return device_type == "cuda"
