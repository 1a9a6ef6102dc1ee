"""What a sample is, in 16 bytes: a digest of its token ids, its loss mask and its source id.

The producer records the digest of every sample of the plan (`table_digests`) in the object store
before the spec names the sample, a round at a time (producer/stored.py); a consumer extracts a
descriptor's sample only when the sample's digest (`sample_digest`) is the recorded one, so that
nothing published by hand (a crafted descriptor with the plan's tag) is written as the job's. The
digest travels on with the file (FileReady, the `uploaded` marker), and a reader of a running
job checks each file's tokens against it (`file_digest`). It knows samples and arrays, not NATS.

The bytes: blake2b-128 over the ids as little-endian int32, then b"\\x01" and the mask as one
byte per token (b"\\x00" without a mask), then the source id in UTF-8.
"""

import hashlib
from collections.abc import Sequence

import numpy as np

from hsx.storage.tokens import SampleTable
from hsx.wire import schemas

DIGEST_BYTES = 16


def digest_of(input_ids: np.ndarray, loss_mask: np.ndarray | None, source_id: str) -> bytes:
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    digest.update(np.ascontiguousarray(input_ids, dtype="<i4").tobytes())
    if loss_mask is None:
        digest.update(b"\x00")
    else:
        digest.update(b"\x01")
        digest.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    digest.update(source_id.encode())
    return digest.digest()


def sample_digest(sample: schemas.Sample) -> bytes:
    """A descriptor's sample, as it would be extracted."""
    mask = sample.mask()
    return digest_of(
        np.asarray(sample.input_ids, dtype=np.int64), None if mask is None else np.asarray(mask), sample.source_id
    )


def file_digest(input_ids: Sequence[int] | np.ndarray, loss_mask, source_id: str) -> bytes:
    """A sample file's tensors (input_ids, loss_mask or None) and its metadata's source id."""
    ids = np.asarray(input_ids, dtype=np.int64)
    return digest_of(ids, None if loss_mask is None else np.asarray(loss_mask), source_id)


def table_digests(table: SampleTable) -> bytes:
    """Every sample's digest, in index order, `DIGEST_BYTES` each."""
    out = bytearray()
    for first, offsets, tokens, masks in table.runs():
        count = len(offsets) - 1
        ids = table.source_ids.slice(first, count).to_pylist()
        has_mask = table.has_mask[first : first + count].tolist()
        bounds = offsets.tolist()
        for k in range(count):
            start, end = bounds[k], bounds[k + 1]
            mask = masks[start:end] if has_mask[k] else None
            out += digest_of(tokens[start:end], mask, ids[k])
    return bytes(out)
