"""The terminal view of `hsx monitor`: one progress line redrawn in place, log lines printed above it.

`render_bar` is a pure function of a reading and a width; `TerminalBar` owns the terminal line.
Chosen when stdout is a terminal (`--format auto`) or with `--format bar`; the JSON lines are
the other view of the same reading.
"""

import threading
from typing import TextIO

from hsx.monitor.report import Reading, live_workers_by_service, percent_uploaded, silent_count
from hsx.wire.statusview import human_duration

_BAR_CELLS = 20
_SERVICE_SHORT = {"gpu_consumer": "gpu", "uploader": "up", "producer": "prod"}
_CLEAR_LINE = "\r\x1b[2K"


def _count(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


def _size(value: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def _cells(fraction: float) -> str:
    filled = min(_BAR_CELLS, max(0, int(fraction * _BAR_CELLS)))
    return "[" + "#" * filled + "." * (_BAR_CELLS - filled) + "]"


def _fit(parts: list[str], width: int, separator: str) -> str:
    """The parts that fit in `width - 1` columns (the last column would make a terminal wrap), in
    order of importance: one that does not fit is left out, never cut in the middle."""
    line = parts[0][: max(0, width - 1)]
    for part in parts[1:]:
        if len(line) + len(separator) + len(part) <= width - 1:
            line += separator + part
    return line


def render_bar(reading: Reading, *, job: str, width: int = 200) -> str:
    """One line, at most `width - 1` characters."""
    view = reading.view
    if view.done:
        return _fit(
            [
                f"{job} done: {view.samples_uploaded}/{view.total_samples} samples"
                + (f" in {human_duration(view.elapsed_s)}" if view.elapsed_s is not None else ""),
                f"{_count(view.tokens_uploaded)} tokens",
                _size(view.bytes_uploaded),
                f"{view.batches_done} batches",
                f"redeliveries {view.batch_redeliveries + view.file_redeliveries}",
                f"dead letters {view.dead_letters}",
            ],
            width,
            ", ",
        )
    percent = percent_uploaded(view)
    workers = (
        " ".join(
            f"{count} {_SERVICE_SHORT.get(service, service)}"
            for service, count in live_workers_by_service(reading).items()
        )
        or "none"
    )
    silent = silent_count(reading)
    parts = [
        f"{job} {_cells(percent / 100)} {percent:5.1f}% {view.samples_uploaded}/{view.total_samples}",
        f"ETA {human_duration(reading.eta_s)}",
        f"{_count(reading.tokens_per_s)} tok/s",
    ]
    if view.failed:
        refused = view.destination_refusals
        parts.append("FAILED: destination refuses uploads" if refused else "FAILED: only dead samples left")
    elif not live_workers_by_service(reading):
        # As the reading's workers say (the view's `state` is the same rule at the view's time).
        anything_done = view.samples_uploaded or view.batches_done or view.samples_written
        parts.append("STALLED: no worker alive" if anything_done else "waiting for workers")
    if view.dead_letters:
        parts.append(f"dead letters {view.dead_letters}")
    parts.append(f"workers {workers}" + (f" ({silent} silent)" if silent else ""))
    if reading.spool:
        parts.append("spool " + ", ".join(f"{node} {_size(used)}" for node, (_files, used) in reading.spool.items()))
    parts.append(f"batches {view.batches_done}/{view.batches_total}")
    return _fit(parts, width, " | ")


class TerminalBar:
    """Draws one line in place on `stream`; text written to `above` appears above it.

    structlog writes through `above` while the bar is on screen, so warnings and the summary
    scroll up and the bar stays the last line. Other processes on the same terminal (workers
    started with `&` in the same shell) write wherever the cursor is: the bar leaves it at the
    start of its line, so their lines are written over the bar from its first column, never
    appended to it, and the next drawing goes below them.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.line = ""
        self._lock = threading.Lock()  # structlog may log from another thread
        self.above = _Above(self)

    def draw(self, line: str) -> None:
        with self._lock:
            self.line = line
            self.stream.write(_CLEAR_LINE + line + "\r")
            self.stream.flush()

    def print_above(self, text: str) -> None:
        with self._lock:
            self.stream.write(_CLEAR_LINE + text.rstrip("\n") + "\n" + self.line + ("\r" if self.line else ""))
            self.stream.flush()

    def clear(self) -> None:
        """Take the drawing off the screen (`hsx up` says the result itself)."""
        with self._lock:
            if self.line:
                self.stream.write(_CLEAR_LINE)
                self.stream.flush()
            self.line = ""

    def finish(self) -> None:
        """Leave the last drawing on screen and move below it."""
        with self._lock:
            if self.line:
                self.stream.write(_CLEAR_LINE + self.line + "\n")
                self.stream.flush()
            self.line = ""


class _Above:
    """The file hsx.logs' logging handler writes to while the bar is shown: whole lines go above the bar."""

    def __init__(self, bar: TerminalBar) -> None:
        self.bar = bar
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            self.bar.print_above(line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:  # structlog's console renderer colours only a terminal
        return self.bar.stream.isatty()
