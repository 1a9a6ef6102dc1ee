"""The one thread a consumer computes on (`DeviceThread`): the model's load, its warm-up and every
forward run there, never on asyncio's default pool.

Why one bound thread: CUDA's current device is per thread and starts at 0. PyTorch's own kernels
follow their tensors' device, but kernels launched by other libraries (flash-linear-attention's
Triton kernels, for one) go to the current device, and a pool thread's is 0 whatever GPU the
model is on. The thread calls `torch.cuda.set_device` once, before anything else runs on it, so
every launch goes where the model is; and one thread means one CUDA context binding, one set of
thread-local caches (compiled graphs, autotuning) warmed up once. The consumer computes one
forward at a time anyway (gpu_consumer/scheduler.py), so nothing waits on this thread that would
have run in parallel.

The consumer has a second one (`name="hsx-land"`): it waits for each batch's copy to the host
(gpu_consumer/extract.py InFlight.wait), so that the forward thread queues the next forward
meanwhile. It knows nothing of batches or models: it runs what it is given, in order.
"""

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import structlog
import torch

log = structlog.get_logger("hsx.gpu_consumer")
T = TypeVar("T")


def bind_to(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing to do off CUDA)."""
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())


class DeviceThread:
    def __init__(self, device: torch.device | str, *, name: str = "hsx-forward") -> None:
        self.device = torch.device(device)
        self.bound_thread: int | None = None  # the thread's ident, once it has bound itself
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=self._bind)

    def _bind(self) -> None:
        bind_to(self.device)
        self.bound_thread = threading.get_ident()
        log.debug("device_thread_bound", device=str(self.device), thread=threading.current_thread().name)

    async def run(self, fn: Callable[..., T], /, *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the device thread, with the caller's contextvars (structlog's
        bound fields), as asyncio.to_thread does."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, partial(context.run, fn, *args, **kwargs)
        )

    def close(self) -> None:
        """No more work; what runs finishes on its own (a hung forward cannot be interrupted, and
        the process is going down)."""
        self._executor.shutdown(wait=False)
