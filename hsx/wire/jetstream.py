"""JetStream helpers every service uses alike: publishing many messages at once, each stored
exactly once (`publish_all`), and handing back a batch a worker will not finish (`give_back`).
They know messages and the stream's rules, not what the messages mean."""

import asyncio

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck

from hsx.logs import get_logger
from hsx.wire import topology
from hsx.wire.natsconn import through_outage

log = get_logger("hsx.jetstream")

# How long the acks of a group of publishes are awaited together before the missing ones are
# published again one by one (their msg ids make a repeat harmless).
_PUBLISH_ACK_WAIT_S = 10.0


async def publish_all(
    js: JetStreamContext,
    messages: list[tuple[str, bytes, dict[str, str]]],
    *,
    what: str,
    stopping: asyncio.Event | None = None,
) -> list[PubAck]:
    """Publish every (subject, payload, headers) to JetStream, each stored before this returns;
    their acks, in order (`duplicate`: the stream held that msg id already).

    The publishes go out back to back and their acks are awaited together (`publish_async`): one
    round trip for a group instead of one each. Any that failed or had no ack within
    _PUBLISH_ACK_WAIT_S (a NATS outage) is published again on its own through the outage
    (`through_outage`, given up when `stopping` is set); every message must carry a Nats-Msg-Id,
    so one stored twice is kept once."""
    futures: list[asyncio.Future] = []
    try:
        for subject, payload, headers in messages:
            futures.append(await js.publish_async(subject, payload, headers=headers))
    except (TimeoutError, nats.errors.Error) as exc:  # disconnected: the rest go one by one below
        log.warning("publish_async_failed", what=what, error=str(exc) or type(exc).__name__)
    if futures:
        _, late = await asyncio.wait(futures, timeout=_PUBLISH_ACK_WAIT_S)
        for future in late:
            future.cancel()  # frees its slot in the client's pending-publish window
    acks: list[PubAck] = []
    for i, (subject, payload, headers) in enumerate(messages):
        if i < len(futures) and not futures[i].cancelled() and futures[i].exception() is None:
            acks.append(futures[i].result())
            continue
        acks.append(
            await through_outage(
                lambda subject=subject, payload=payload, headers=headers: js.publish(subject, payload, headers=headers),
                what=what,
                stopping=stopping,
            )
        )
    return acks


async def give_back(js: JetStreamContext, msg: Msg) -> None:
    """Hand back a batch this worker will not finish (it is stopping). A nak sends it to another
    consumer at once; on its last delivery a nak would strand it (JetStream never delivers it
    again), so a fresh copy is published first and the spent one removed. A crash between the two
    leaves both: the batch runs twice, which is harmless (same files, progress counts samples)."""
    if msg.metadata.num_delivered < topology.BATCH_MAX_DELIVER:
        await msg.nak()
        return
    seq = msg.metadata.sequence.stream
    headers = {**(msg.headers or {}), "Nats-Msg-Id": f"requeue:{seq}"}
    await through_outage(lambda: js.publish(msg.subject, msg.data, headers=headers), what="requeue_batch")
    await through_outage(msg.term, what="remove_requeued_batch")
    log.info("batch_requeued_fresh", seq=seq, deliveries=msg.metadata.num_delivered)
