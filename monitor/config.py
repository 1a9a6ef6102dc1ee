"""The monitor's settings, built and validated once by the CLI."""

from dataclasses import dataclass
from typing import Literal

from hsx.wire.natsconn import NatsSettings


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    nats: NatsSettings
    job: str
    interval_s: float = 5.0
    until_done: bool = False
    # A worker whose last heartbeat is older than this is reported silent; well above the
    # workers' heartbeat interval (5 s), so one late beat is not an alarm.
    silent_after_s: float = 30.0
    # "bar": one line redrawn in place on stdout (a terminal); "json": one JSON object per line
    # on stdout. The CLI resolves --format auto from whether stdout is a terminal.
    output: Literal["bar", "json"] = "json"
    log_level: str = "info"
    metrics_port: int = 0  # 0: no /metrics
    metrics_host: str = "0.0.0.0"
