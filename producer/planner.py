"""The plan's batch ids, as the producer names them (declared with the wire messages,
hsx.wire.schemas.plan_batch_id, since consumers tell the plan's batches from others by them).
The packing itself is hsx/packing.py, shared with the trainer-side sampler."""

from hsx.wire.schemas import plan_batch_id

__all__ = ["plan_batch_id"]
