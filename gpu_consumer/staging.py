"""Host buffers for device-to-host copies of captured states, leased to one batch at a time
(`HostStaging`, `StagingLease`): pinned where CUDA is available, kept and reused, and none of a
lease handed out again until the lease is released, once the batch's files (written straight
from these buffers) are written. It knows nothing of batches, files, streams or messages: it hands
out buffers and takes them back, never while a copy into one may still run (`StagingLease.fence`).

Why pinned, and how much memory it holds: docs/architecture/consumer.md.
"""

import threading
from typing import Protocol

import torch


def block_bytes(nbytes: int) -> int:
    """What the host allocator really holds for a request of `nbytes`: torch's pinned (caching
    host) allocator rounds every request up to the next power of two, so the pool asks for that
    size itself and counts it; a buffer's numel is then what it holds. Rounding is the headroom:
    a slightly larger batch next time usually fits the same block."""
    return 1 << max(0, nbytes - 1).bit_length()


class HostStaging:
    """The pool. Thread-safe: forwards take on the device thread, the event loop releases."""

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._leased_bytes = 0
        self._largest = 0

    def lease(self) -> "StagingLease":
        return StagingLease(self)

    @property
    def leased_bytes(self) -> int:
        return self._leased_bytes

    @property
    def held_bytes(self) -> int:
        """Leased and free buffers together: what the pool keeps allocated."""
        with self._lock:
            return self._leased_bytes + sum(buffer.numel() for buffer in self._free)

    def _acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, buffer in enumerate(self._free) if buffer.numel() >= nbytes]
            if fits:
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self._leased_bytes += buffer.numel()
                return buffer
        # Outside the lock: a pinned allocation can take a while, and releases need not wait for it.
        buffer = torch.empty(block_bytes(nbytes), dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self._leased_bytes += buffer.numel()
            self._largest = max(self._largest, buffer.numel())
        return buffer

    def _give_back(self, buffers: list[torch.Tensor]) -> None:
        if not buffers:
            return
        with self._lock:
            self._leased_bytes -= sum(buffer.numel() for buffer in buffers)
            self._free.extend(buffers)
            self._free.sort(key=lambda buffer: buffer.numel())
            free = sum(buffer.numel() for buffer in self._free)
            while self._free and self._leased_bytes + free > 2 * self._largest:
                free -= self._free.pop(0).numel()


class Fence(Protocol):
    """What a copy into a buffer is done at: a CUDA event (or anything that can be waited for)."""

    def synchronize(self) -> None: ...


class StagingLease:
    """The buffers one batch's forwards copied into. None is handed out again before `release()`;
    a tensor from `take` is valid until then, and must not be read after it.

    A copy into a buffer may still run when the lease gives it back (a forward that failed after
    an earlier part's copy was queued): `fence` names what the copies into the buffers taken so
    far are done at, and a buffer goes back to the pool only once its fence has passed."""

    def __init__(self, pool: HostStaging) -> None:
        self._pool = pool
        self._buffers: list[torch.Tensor] = []
        self._fences: list[Fence | None] = []  # one per buffer: what its copy is done at
        self._released = False

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if self._released:
            raise RuntimeError("staging lease already released")
        nbytes = shape.numel() * dtype.itemsize
        buffer = self._pool._acquire(nbytes)
        self._buffers.append(buffer)
        self._fences.append(None)
        return buffer[:nbytes].view(dtype).view(shape)

    def fence(self, done: Fence) -> None:
        """The copies into the buffers taken since the last fence are done at `done`."""
        for i in range(len(self._fences) - 1, -1, -1):
            if self._fences[i] is not None:
                break
            self._fences[i] = done

    def mark(self) -> int:
        """A point to give back to if what follows fails (`release_since`)."""
        return len(self._buffers)

    def release_since(self, mark: int) -> None:
        """Give back the buffers taken after `mark`: those of a forward that failed, whose states
        nobody will read."""
        returned, self._buffers = self._buffers[mark:], self._buffers[:mark]
        fences, self._fences = self._fences[mark:], self._fences[:mark]
        for fence in {id(f): f for f in fences if f is not None}.values():  # each once
            fence.synchronize()
        self._pool._give_back(returned)

    def release(self) -> None:
        """Give back every buffer (the batch's files are written, or it will write none).
        Idempotent."""
        if not self._released:
            self._released = True
            self.release_since(0)

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() for buffer in self._buffers)
