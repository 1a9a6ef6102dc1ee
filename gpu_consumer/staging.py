"""Pinned host buffers for device-to-host copies of captured states.

A copy from pageable host memory runs at a few GB/s and blocks; into pinned (page-locked) memory
it runs at full PCIe/NVLink-C2C speed and can be asynchronous. Pinned allocations are slow to
make, so buffers are kept and reused: a ring of `slots` buffers, each grown to the largest batch
seen. A tensor handed out stays valid until its slot comes round again (`slots` calls later), so
callers must be done with a batch's states (written to disk) by then, or copy them.
"""

import torch


class HostStaging:
    def __init__(self, *, slots: int = 2) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._next = 0

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        slot = self._next
        self._next = (self._next + 1) % len(self._buffers)
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            # Grow with headroom so a slightly larger batch does not allocate again.
            buffer = torch.empty(int(nbytes * 1.25) + 1, dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buffer
        return buffer[:nbytes].view(dtype).view(shape)

    @property
    def slots(self) -> int:
        return len(self._buffers)
