"""The monitor's settings, built and validated once by the CLI."""

from dataclasses import dataclass

from hsx.natsconn import NatsSettings


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    nats: NatsSettings
    job: str
    interval_s: float = 5.0
    until_done: bool = False
    silent_after_s: float = 30.0
