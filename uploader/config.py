"""The uploader's settings, built and validated once by the CLI. The destination comes from
the job spec, so every uploader of a job writes to the same place."""

from dataclasses import dataclass

from hsx.wire.worker import WorkerConfig


@dataclass(frozen=True, kw_only=True)
class UploaderConfig(WorkerConfig):
    max_inflight: int = 100
    stop_deadline_s: float = 60.0
    retry_base_s: float = 1.0  # a transient failure's retries wait up to 1, 2, 4, ... s (jittered)
    retry_max_s: float = 30.0
    # While the destination refuses (hsx.storage.destinations: a missing bucket, bad credentials, ...),
    # one upload in hand tries again this often (jittered) and the others wait for it.
    probe_every_s: float = 30.0
