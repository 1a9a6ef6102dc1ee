"""A CUDA device's utilization and memory as nvidia-smi shows them, for the consumer's heartbeat
(schemas.WorkerLoad): `GpuReader(device).read()` -> (utilization %, memory used, memory total).

Memory comes from `torch.cuda.mem_get_info` (cudaMemGetInfo: the whole device's free and total
bytes, every process's allocations included, as nvidia-smi counts them), which needs nothing
beyond torch. Utilization (the share of the last sample period in which a kernel ran) exists
only in NVML: `torch.cuda.utilization`, which maps the device through CUDA_VISIBLE_DEVICES to
NVML's index and needs the `pynvml` module (the nvidia-ml-py wheel, in hsx's `gpu` extra). Where
NVML cannot be read (no such module, a driver without it) utilization is -1 and memory is still
reported; the first failure is logged once. Off CUDA there is nothing to read: `read()` is None.
Knows nothing of heartbeats or batches.
"""

import structlog
import torch

log = structlog.get_logger("hsx.gpu_consumer")

UNKNOWN = -1


class GpuReader:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._utilization = device.type == "cuda"  # False once NVML has failed: not asked again

    def read(self) -> tuple[float, int, int] | None:
        """(utilization in percent or -1, memory used, memory total) in bytes; None off CUDA or
        when the device cannot be asked (the heartbeat goes out without it)."""
        if self.device.type != "cuda":
            return None
        try:
            free, total = torch.cuda.mem_get_info(self.device)
        except Exception as exc:  # noqa: BLE001 - a device in trouble: the forward will say so
            log.debug("gpu_memory_unknown", device=str(self.device), error=str(exc) or type(exc).__name__)
            return None
        return self._read_utilization(), int(total - free), int(total)

    def _read_utilization(self) -> float:
        if not self._utilization:
            return UNKNOWN
        try:
            return float(torch.cuda.utilization(self.device))
        except Exception as exc:  # noqa: BLE001 - no pynvml, or NVML not usable: memory alone
            self._utilization = False
            log.info(
                "gpu_utilization_unknown",
                device=str(self.device),
                reason=f"{type(exc).__name__}: {exc}"[:200],
                hint="pip install nvidia-ml-py (in hsx-extract[gpu]) for the GPU's utilization",
            )
            return UNKNOWN
