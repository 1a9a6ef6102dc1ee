"""Graceful shutdown: a signal sets an event; services stop fetching, finish in-flight work
within their deadline, then drain their NATS connection."""

import asyncio
import signal


def stop_event_on_signals() -> asyncio.Event:
    """SIGTERM and SIGINT set the returned event (the first one); call inside the running loop."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    return stopping
