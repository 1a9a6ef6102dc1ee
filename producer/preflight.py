"""What the producer checks before it writes anything for a job: every batch descriptor fits the
NATS server's max_payload, and the destination takes a write.

Both used to be found late: an oversized descriptor mid-publish, after the job spec and some
batches were in (and a re-run with a smaller --token-budget was then refused as another plan);
a destination that cannot be written only after the whole job was published, with uploaders
retrying it forever. Checked first, a refusal leaves nothing behind: no spec, no stored
samples, no batch.

A descriptor must leave room for the dead letter it may become (`schemas.dead_letter_headroom`):
a letter carries the descriptor plus its error and indices, and must fit max_payload too. Each
descriptor is encoded, measured and dropped, so the check holds one payload at a time.
"""

import math
import uuid
from collections.abc import Iterable

from hsx.errors import HsxError
from hsx.storage.destinations import open_destination, probe
from hsx.storage.layout import bundle_key
from hsx.wire import schemas

# The suggested --token-budget aims this far under the limit: batches of a smaller budget pack
# differently, and their bytes per token vary with the samples they get.
_SUGGESTION_MARGIN = 0.9


def check_payloads(
    descriptors: Iterable[schemas.BatchDescriptor], *, max_payload: int, token_budget: int, max_seq_len: int
) -> int:
    """Refuse the plan if a descriptor plus its dead-letter headroom exceeds max_payload; the
    error names the largest such batch and suggests a --token-budget that fits. Returns the
    number of descriptors checked."""
    checked = too_big = 0
    worst: tuple[int, schemas.BatchDescriptor, int] | None = None  # (bytes needed, descriptor, encoded size)
    bytes_per_token = 0.0  # the most any batch needs per token, its headroom for samples included
    per_sample_headroom = schemas.dead_letter_headroom(1) - schemas.dead_letter_headroom(0)
    for descriptor in descriptors:
        checked += 1
        size = len(schemas.encode(descriptor))
        samples = len(descriptor.samples)
        needed = size + schemas.dead_letter_headroom(samples)
        tokens = sum(len(sample.input_ids) for sample in descriptor.samples)
        bytes_per_token = max(bytes_per_token, (size + per_sample_headroom * samples) / max(tokens, 1))
        if needed > max_payload:
            too_big += 1
            if worst is None or needed > worst[0]:
                worst = (needed, descriptor, size)
    if worst is None:
        return checked
    needed, descriptor, size = worst
    samples = len(descriptor.samples)
    what = (
        f"batch {descriptor.batch_id} ({samples} samples, padded to {descriptor.padded_len} tokens) encodes to "
        f"{size} bytes, and with the {needed - size} bytes kept for its dead letter needs {needed}: more than the "
        f"NATS server's max_payload {max_payload} ({too_big} of {checked} batches are too large)"
    )
    room = max_payload - schemas.dead_letter_headroom(0)
    budget = int(room / bytes_per_token * _SUGGESTION_MARGIN) if room > 0 and bytes_per_token else 0
    budget = min(budget, token_budget - 1)
    if samples == 1 or budget < max_seq_len:
        advice = (
            f"one sample of --max-seq-len {max_seq_len} tokens may not fit: raise max_payload on the server "
            f"(e.g. max_payload: {_round_up_mib(needed)}) or lower --max-seq-len"
        )
    else:
        advice = f"run again with --token-budget {budget} (or less), or raise max_payload on the server"
    raise HsxError(f"{what}; nothing was published; {advice}")


def _round_up_mib(size: int) -> str:
    return f"{math.ceil(size / (1 << 20))}MB"


def check_destination(dest_url: str, job: str) -> None:
    """Write, read back and delete a small object under `<dest>/<job>/_hsx/`; refuse the job with
    one line naming the place and the reason (a missing bucket, credentials, a permission, a
    file where a directory must be) when any of it fails."""
    key = bundle_key(job, f"probe-{uuid.uuid4().hex[:12]}")
    where = f"{dest_url.rstrip('/')}/{bundle_key(job, '')}"
    dest = None
    try:
        dest = open_destination(dest_url, max_connections=1)
        probe(dest, key)
    except Exception as exc:  # any failure means the job's files cannot go there
        reason = dest.refusal(exc) if dest is not None else None
        if reason and reason.startswith(f"{dest.url}: "):
            reason = reason[len(dest.url) + 2 :]
        reason = reason or " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise HsxError(
            f"--dest {dest_url}: cannot write there (tried a small object under {where}): {reason}; "
            "nothing was published"
        ) from None
