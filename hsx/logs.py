"""structlog set-up, done once per process in its entry point.

JSON lines when stderr is not a terminal (containers, log shippers, `hsx up` children), a
readable console when it is. Context (job, batch, attempt) is bound with contextvars per message.
The monitor, whose log is its product, sends it to stdout instead (or above its progress bar).

Everything goes out through one stdlib `logging` handler with structlog's ProcessorFormatter:
hsx's own events, and the records of the libraries underneath (nats-py, botocore, transformers),
which thereby come out as the same JSON lines with the same fields (timestamp, level, job, ...)
instead of bare text in between. An exception logged with `exc_info` carries its traceback
(`exception` field).
"""

import logging
import os
import sys
from typing import TextIO

import structlog

# The handler configure_logging installed on the root logger, replaced when it is called again.
_handler: logging.Handler | None = None
_CHATTY_LIBRARIES = ("botocore", "boto3", "s3transfer", "urllib3", "asyncio", "filelock", "fsspec", "httpx", "httpcore")
# Loggers whose info says nothing a user needs, on every run: warnings only, whatever --log-level
# ("Found credentials in environment variables." on every S3 command).
_WARNINGS_ONLY = ("botocore.credentials",)


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
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        *exceptions,
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    global _handler
    handler = logging.StreamHandler(file) if file is not sys.stderr else _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,  # records of other libraries: the fields hsx's own events get
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    if _handler is not None:  # configured again (the monitor moves its log to stdout)
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    _handler = handler
    # Libraries that narrate every request at debug level stay at info even with --log-level debug.
    for chatty in _CHATTY_LIBRARIES:
        logging.getLogger(chatty).setLevel(max(numeric_level, logging.INFO))
    for quiet in _WARNINGS_ONLY:
        logging.getLogger(quiet).setLevel(max(numeric_level, logging.WARNING))
    logging.captureWarnings(True)


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
