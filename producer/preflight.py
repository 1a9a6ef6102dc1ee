"""What the producer checks before it writes anything for a job: every batch descriptor fits the
NATS server's max_payload with room for its dead letter (`check_payloads`), the destination
takes a write (`check_destination`), and the job's folder there holds no other plan's files
(`check_folder`, `folder_owner`). A refusal leaves nothing behind.

The checks and their messages: docs/operations/planning.md, "What the producer checks"; why:
docs/architecture/producer.md.
"""

import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.storage.destinations import Destination, probe
from hsx.storage.expected import read_metadata
from hsx.storage.index import BUNDLE_SPEC_KEY, HEADER_PROBE_BYTES, bundle_spec
from hsx.storage.layout import bundle_key, sample_index_of
from hsx.storage.location import Location, open_destination, open_job_folder
from hsx.storage.samplefile import SampleFileCorrupt
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


def check_destination(dest: Location, job: str) -> None:
    """Write, read back and delete a small object under `<dest>/<job>/_hsx/`; refuse the job with
    one line naming the place and the reason (a missing bucket, credentials, a permission, a
    file where a directory must be) when any of it fails."""
    key = bundle_key(job, f"probe-{uuid.uuid4().hex[:12]}")
    where = f"{dest}/{bundle_key(job, '')}"
    opened = None
    try:
        opened = open_destination(dest, max_connections=1)
        probe(opened, key)
    except Exception as exc:  # any failure means the job's files cannot go there
        reason = opened.refusal(exc) if opened is not None else None
        if reason and reason.startswith(f"{opened.url}: "):
            reason = reason[len(opened.url) + 2 :]
        reason = reason or " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise HsxError(
            f"--dest {dest}: cannot write there (tried a small object under {where}): {reason}; nothing was published"
        ) from None


@dataclass(frozen=True, kw_only=True)
class FolderOwner:
    """The plan a job folder's files were made for, as far as they say."""

    plan: str  # its JobSpec.plan_tag; "" when the files do not say
    what: str  # how a message names it
    # Sample files of this job from an hsx before plans: the job's spec in KV, if any, is theirs.
    before_plans: bool = False


def folder_owner(folder: Destination, job: str) -> FolderOwner | None:
    """Whose files the job folder `folder` holds: its bundle's job.json, else the metadata of the
    first sample file listed; None when it holds neither."""
    spec = bundle_spec(folder)
    if spec is not None:
        made = f"{spec.total_samples} samples, model {spec.model}, layers {list(spec.layers)}"
        return FolderOwner(plan=spec.plan_tag, what=f"plan {spec.plan_tag} ({made}; its {BUNDLE_SPEC_KEY})")
    key = next((key for key in folder.keys() if sample_index_of(job, key) is not None), None)
    if key is None:
        return None
    try:
        metadata = read_metadata(folder.read_prefix(key, HEADER_PROBE_BYTES)[0])
    except SampleFileCorrupt as exc:
        return FolderOwner(plan="", what=f"sample files whose plan cannot be read ({key}: {exc}), no {BUNDLE_SPEC_KEY}")
    made = f"model {metadata.get('model', '?')}, layers {metadata.get('layers', '?')}, e.g. {key}"
    if metadata.get("job") != job:
        return FolderOwner(plan="", what=f"sample files of job {metadata.get('job')} ({made}), no {BUNDLE_SPEC_KEY}")
    plan = metadata.get("plan", "")
    if plan:
        return FolderOwner(plan=plan, what=f"sample files of plan {plan} ({made}), no {BUNDLE_SPEC_KEY}")
    return FolderOwner(
        plan="", what=f"sample files that name no plan, by an hsx from before plans ({made})", before_plans=True
    )


def check_folder(
    dest: Location,
    job: str,
    *,
    plan: str,
    total_samples: int,
    known: JobSpec | None,
    replace: bool,
) -> FolderOwner | None:
    """Refuse, in one line, a job folder that holds another plan's files, unless `replace` (the
    user's --replace-output) or unless they are `known`'s: the job's spec in KV, which this run
    re-runs or, unpublished, replaces (producer/main.py decides whether it may). Returns the
    owner this run takes the folder from (its stale bundle is the caller's to remove), None when
    the folder is empty or already this plan's."""
    where = str(dest.child(job))
    folder = None
    try:
        folder = open_job_folder(dest, job, max_connections=2)
        owner = folder_owner(folder, job)
    except HsxError:
        raise
    except Exception as exc:  # the probe wrote and read; a listing or a read can still be refused
        reason = folder.refusal(exc) if folder is not None else None
        reason = reason or " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise HsxError(
            f"{where}: cannot tell whose files the job's folder holds ({reason}); nothing was published"
        ) from None
    if owner is None or owner.plan == plan:
        return None
    if replace:
        return owner
    if known is not None and known.dest == str(dest):
        # The files of the job's spec in KV: this run re-runs it, or replaces it unpublished.
        theirs = owner.plan == known.plan_tag if owner.plan else owner.before_plans
        if theirs:
            return owner if known.plan_tag != plan else None
    raise HsxError(
        f"{where} holds {owner.what}, not this job's plan {plan} ({total_samples} samples): left by a deleted job of "
        "this name or written by another; nothing was published; use another --job name or another --dest, or "
        "pass --replace-output to let this job replace those files"
    )
