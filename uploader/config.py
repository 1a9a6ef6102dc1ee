"""The uploader's settings, built and validated once by the CLI. The destination comes from
the job spec, so every uploader of a job writes to the same place."""

from dataclasses import dataclass
from pathlib import Path

from hsx.natsconn import NatsSettings


@dataclass(frozen=True, kw_only=True)
class UploaderConfig:
    nats: NatsSettings
    job: str
    spool: Path
    node: str
    instance: str
    max_inflight: int = 100
    ack_wait_s: float = 60.0
    heartbeat_s: float = 5.0
    idle_fetch_timeout_s: float = 1.0
    stop_deadline_s: float = 60.0
    retry_base_s: float = 1.0  # a transient failure's retries wait up to 1, 2, 4, ... s (jittered)
    retry_max_s: float = 30.0
    # While the destination refuses (hsx.destinations: a missing bucket, bad credentials, ...),
    # one upload in hand tries again this often (jittered) and the others wait for it.
    probe_every_s: float = 30.0

    @property
    def in_progress_s(self) -> float:
        return max(0.5, min(10.0, self.ack_wait_s / 3))
