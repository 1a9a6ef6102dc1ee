"""The monitor's settings; each flag is declared on its field (hsx/config/fields.py)."""

from dataclasses import dataclass
from typing import Literal

from hsx.config.fields import option
from hsx.config.values import port_or_off, positive_float
from hsx.wire.health import listen_address, parse_listen
from hsx.wire.natsconn import NatsSettings
from hsx.wire.topology import job_name

# --http without an address: the page is for this machine unless told otherwise.
HTTP_DEFAULT_ADDR = "127.0.0.1"


# --format: auto is resolved by the entry point, from whether stdout is a terminal.
MONITOR_FORMATS = ("auto", "bar", "json")


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    nats: NatsSettings
    log_level: str = "info"  # the global --log-level
    # No flag: `hsx up` runs its monitor with False and prints the result itself, once.
    leave_bar: bool = True
    job: str = option(
        "--job",
        parse=job_name,
        job=True,
        file_key="name",
        env="HSX_JOB",
        example="qwen27b-l5",
        help="the job to follow",
    )
    until_done: bool = option(
        "--until-done",
        default=False,
        env="HSX_UNTIL_DONE",
        help="exit 0 when the job is done, 65 when it cannot finish (everything left is dead-lettered)",
    )
    interval_s: float = option(
        "--interval",
        default=5.0,
        parse=positive_float("--interval"),
        env="HSX_MONITOR_INTERVAL",
        help="seconds between readings (default 5)",
    )
    # "bar": one line redrawn in place on stdout (a terminal); "json": one JSON object per line on stdout.
    output: Literal["bar", "json"] = option(
        "--format",
        default="auto",
        choices=MONITOR_FORMATS,
        env="HSX_MONITOR_FORMAT",
        help="bar: one line redrawn in place; json: one JSON object per line; auto: bar when "
        "stdout is a terminal, else json (env HSX_MONITOR_FORMAT, default auto)",
    )
    # A worker whose last heartbeat is older than this is reported silent; well above the
    # workers' heartbeat interval (5 s), so one late beat is not an alarm.
    silent_after_s: float = option(
        "--silent-after",
        default=30.0,
        parse=positive_float("--silent-after"),
        env="HSX_SILENT_AFTER",
        help="report a worker whose last heartbeat is older than this many seconds (default 30)",
    )
    metrics_port: int = option(
        "--metrics-port",
        default=0,
        parse=port_or_off("--metrics-port"),
        env="HSX_METRICS_PORT",
        help="serve Prometheus metrics on this port at /metrics, e.g. 9108 (env HSX_METRICS_PORT, default 0: off)",
    )
    metrics_host: str = option(
        "--metrics-host",
        default="0.0.0.0",
        env="HSX_METRICS_HOST",
        help="address /metrics listens on (env HSX_METRICS_HOST, default %(default)s)",
    )
    # The job's page (monitor/web.py): off unless given.
    http: str | None = option(
        "--http",
        default=None,
        parse=parse_listen("--http"),
        env="HSX_HTTP_PORT",
        metavar="[ADDR:]PORT",
        example="8080",
        help="serve the job's live page at http://ADDR:PORT/ (GET /api/status: what hsx status --json prints); "
        "ADDR is 127.0.0.1 unless given, e.g. 0.0.0.0:8080 (env HSX_HTTP_PORT, default: off)",
    )

    @property
    def http_listen(self) -> tuple[str, int] | None:
        return None if self.http is None else listen_address(self.http, HTTP_DEFAULT_ADDR)
