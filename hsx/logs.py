"""Logging: hsx's library modules log through the standard `logging` module; the services
configure the output once, in their entry point.

`get_logger(name)` is a library module's logger (hsx.wire, hsx.storage: what a training script
imports with HiddenStateDataset or JobStream): structlog's API (events with key-value fields)
over `logging.getLogger(name)`, with no set-up of its own and not structlog's global
configuration. Used as a library, hsx therefore does what any library does: nothing on stdout,
info dropped unless the program configures `logging` (`logging.basicConfig(level=logging.INFO)`
puts it on stderr), warnings and errors on stderr through logging's last resort. A record's
message reads `event key=value ...`. The services' own modules keep `structlog.get_logger`.

`configure_logging`, called by each service's `main()`: JSON lines when stderr is not a terminal
(containers, log shippers, `hsx up` children), a readable console when it is. Context (job,
batch, attempt) is bound with contextvars per message. The monitor, whose log is its product,
sends it to stdout instead (or above its progress bar).

Everything then goes out through one stdlib `logging` handler with structlog's
ProcessorFormatter: the services' events, the library modules' records, and the records of the
libraries underneath (nats-py, a destination's client, transformers), which thereby come out as the same JSON
lines with the same fields (timestamp, level, job, ...) instead of bare text in between. An
exception logged with `exc_info` carries its traceback (`exception` field).
"""

import logging
import os
import sys
from typing import TextIO

import structlog

# The handler configure_logging installed on the root logger, replaced when it is called again.
_handler: logging.Handler | None = None
_level = logging.INFO  # the level configure_logging set last
# Loggers of libraries that narrate every request at debug level (kept at info whatever --log-level),
# or whose info says nothing a user needs on every run (kept at warning): name -> the least level.
# A library's module names its own with quiet_library (the destinations name their clients').
_QUIET = {name: logging.INFO for name in ("urllib3", "asyncio", "filelock", "fsspec", "httpx", "httpcore")}


def configure_logging(*, json: bool | None = None, level: str = "info", file: TextIO | None = None) -> None:
    """`file` (default stderr) receives the lines; JSON unless it is a terminal, when `json` is None."""
    # Hugging Face progress bars would interleave with the structured stream.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    file = sys.stderr if file is None else file
    on_terminal = getattr(file, "isatty", lambda: False)()
    if json is None:
        json = not on_terminal
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=on_terminal)
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    # The console renderer draws exceptions itself; JSON gets the traceback as a string field.
    exceptions = [structlog.processors.format_exc_info] if json else []
    # Applied in the handler, to every record alike: the services' structlog events, the library
    # modules' (get_logger) and other libraries'; the context is merged where each is logged.
    fields = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        *exceptions,
    ]
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    global _handler
    handler = logging.StreamHandler(file) if file is not sys.stderr else _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.contextvars.merge_contextvars],  # records of other libraries
            processors=[*fields, structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    if _handler is not None:  # configured again (the monitor moves its log to stdout)
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    global _level
    _handler, _level = handler, numeric_level
    for name, least in _QUIET.items():
        logging.getLogger(name).setLevel(max(numeric_level, least))
    logging.captureWarnings(True)


def quiet_library(*names: str, warnings_only: bool = False) -> None:
    """Loggers of a library that narrate every request at debug level: at info at least, whatever
    --log-level; `warnings_only`: ones whose info says nothing a user needs ("Found credentials in
    environment variables." on every command), at warning at least. Applied by configure_logging,
    at once if it ran already; a program using hsx as a library keeps its own levels."""
    least = logging.WARNING if warnings_only else logging.INFO
    for name in names:
        _QUIET[name] = least
        if _handler is not None:
            logging.getLogger(name).setLevel(max(_level, least))


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A library module's logger (`log.info("event", key=value)`), over `logging.getLogger(name)`:
    quiet, or where the program's `logging` set-up sends it (module docstring)."""
    return structlog.stdlib.BoundLogger(logging.getLogger(name), _LIBRARY_PROCESSORS, {})


class _Event(dict):
    """A library record's message: the event dict, as ProcessorFormatter reads it when
    configure_logging ran, and `event key=value ...` as any other formatter prints it."""

    def __str__(self) -> str:
        fields = (f"{key}={_shown(value)}" for key, value in self.items() if key not in _NOT_SHOWN)
        return " ".join((str(self.get("event", "")), *fields))


_NOT_SHOWN = ("event", "exc_info", "stack_info")


def _shown(value: object) -> str:
    text = str(value)
    return repr(text) if not text or any(c.isspace() or c in "'\"=" for c in text) else text


def _to_record(logger: logging.Logger, method_name: str, event_dict: dict) -> tuple[tuple, dict]:
    """The last processor of get_logger's: the arguments of the stdlib call, with the traceback
    (exc_info=True, taken now) on the record for stdlib formatters and in the event for
    ProcessorFormatter."""
    exc_info = event_dict.get("exc_info")
    if exc_info is True:
        exc_info = sys.exc_info()
        if exc_info[0] is None:
            exc_info = None
            event_dict.pop("exc_info")
        else:
            event_dict["exc_info"] = exc_info
    extra = {"_logger": logger, "_name": method_name}
    return (_Event(event_dict),), {"extra": extra, "exc_info": exc_info or None}


_LIBRARY_PROCESSORS = [
    structlog.stdlib.filter_by_level,  # first: nothing is built for a record no one takes
    structlog.contextvars.merge_contextvars,
    _to_record,
]


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (as logging's own last-resort
    handler does): code that swaps stderr (contextlib.redirect_stderr, pytest's capture) gets the
    lines, and a stream closed since is never written to."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def route_transformers_logging() -> None:
    """transformers gives its loggers a stderr handler of its own and stops them propagating: hand
    its records to the root handler, so its warnings come out in the same JSON stream. Called
    where transformers is imported (importing it here would cost every command most of a second);
    a no-op unless configure_logging ran, so a program using hsx as a library keeps its own set-up."""
    if _handler is None:
        return
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
