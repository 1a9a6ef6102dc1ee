"""The headers hsx puts on every message it publishes, named here and nowhere else.

They say which job, batch and sample a message belongs to without decoding its JSON payload:
`nats sub`, `nats stream get` and `nats stream view` print them, and a tool can select on them.
The payload stays the authority; the headers repeat what it says (and, for progress events
whose payload has no batch id, which batch the sample came from).

- `Hsx-Job` on every message.
- `Hsx-Batch` where the message concerns one batch: batch descriptors, file-ready events,
  `written`/`uploaded`/`requeued` events, dead letters of a batch or file.
- `Hsx-Sample` where it concerns exactly one sample: file-ready, `uploaded` and `requeued`
  events, the one-sample batch an uploader re-queues, a dead letter of one sample.
- `Hsx-Retry-Of` on a dead letter sent back by `hsx dead retry`: its sequence in HSX_DEAD.
- `Nats-Msg-Id` (JetStream's de-duplication id, within the stream's duplicate window) where a
  repeated publish must not make a second message: descriptors, file-ready events, retries.
"""

JOB = "Hsx-Job"
BATCH = "Hsx-Batch"
SAMPLE = "Hsx-Sample"
RETRY_OF = "Hsx-Retry-Of"
MSG_ID = "Nats-Msg-Id"


def message_headers(
    job: str,
    *,
    batch: str = "",
    sample: int | None = None,
    msg_id: str = "",
    retry_of: int | None = None,
) -> dict[str, str]:
    """The headers of one message; empty values are left out, never sent blank."""
    values = {
        JOB: job,
        BATCH: batch,
        SAMPLE: "" if sample is None else str(sample),
        MSG_ID: msg_id,
        RETRY_OF: "" if retry_of is None else str(retry_of),
    }
    return {name: value for name, value in values.items() if value}
