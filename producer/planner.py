"""The plan's batch ids. The packing itself is hsx/packing.py, shared with the trainer-side sampler."""

from hsx.wire.schemas import plan_tag_of


def plan_batch_id(job: str, fingerprint: str, seq: int) -> str:
    """The id of the plan's `seq`-th batch: the same samples and settings (the plan's fingerprint)
    always give the same ids, which go out as `Nats-Msg-Id` and into the job bundle's plan."""
    return f"{job}-{plan_tag_of(fingerprint)}-{seq:06d}"
