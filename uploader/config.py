"""The uploader's settings; each flag is declared on its field (hsx/config/fields.py). The
destination comes from the job spec, so every uploader of a job writes to the same place."""

from dataclasses import dataclass

from hsx.config.fields import option
from hsx.config.values import positive_float, positive_int
from hsx.wire.worker import WorkerConfig


@dataclass(frozen=True, kw_only=True)
class UploaderConfig(WorkerConfig):
    max_inflight: int = option(
        "--max-inflight",
        default=100,
        parse=positive_int("--max-inflight"),
        env="HSX_MAX_INFLIGHT",
        help="uploads in flight at once (default 100)",
    )
    stop_deadline_s: float = 60.0
    retry_base_s: float = 1.0  # a transient failure's retries wait up to 1, 2, 4, ... s (jittered)
    retry_max_s: float = 30.0
    # While the destination refuses (hsx/storage/destinations/: a missing bucket, bad credentials, ...),
    # one upload in hand tries again this often (jittered) and the others wait for it.
    probe_every_s: float = option(
        "--probe-every",
        default=30.0,
        parse=positive_float("--probe-every"),
        env="HSX_PROBE_EVERY",
        help="while the destination refuses uploads (missing bucket, bad credentials, denied), "
        "try it again every this many seconds (env HSX_PROBE_EVERY, default 30)",
    )
