"""structlog set-up, done once per process in its entry point.

JSON lines when stderr is not a terminal (containers, log shippers, `hsx up` children), a
readable console when it is. Context (job, batch, attempt) is bound with contextvars per message.
The monitor, whose log is its product, sends it to stdout instead (or above its progress bar).
"""

import logging
import os
import sys
from typing import TextIO

import structlog


def configure_logging(*, json: bool | None = None, level: str = "info", file: TextIO | None = None) -> None:
    """`file` (default stderr) receives the lines; JSON unless it is a terminal, when `json` is None."""
    # Hugging Face progress bars would interleave with the structured stream.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    file = sys.stderr if file is None else file
    on_terminal = getattr(file, "isatty", lambda: False)()
    if json is None:
        json = not on_terminal
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=on_terminal)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=file),
        cache_logger_on_first_use=True,
    )
