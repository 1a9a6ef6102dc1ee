"""The headers hsx puts on every message it publishes (`JOB`, `BATCH`, `SAMPLE`, `RETRY_OF`,
`MSG_ID`; `message_headers` makes them), named here and nowhere else. They repeat what the
payload says, which stays the authority, so that `nats` tools and scripts can tell messages
apart without decoding them. Which message carries which: docs/operations/nats.md, "Headers".
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
