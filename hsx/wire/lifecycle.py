"""Graceful shutdown: a signal sets an event; services stop fetching, finish in-flight work
within their deadline, then drain their NATS connection."""

import asyncio
import signal
import threading


def stop_event_on_signals() -> asyncio.Event:
    """SIGTERM and SIGINT set the returned event (the first one); call inside the running loop."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    return stopping


def stop_flag_on_signals() -> threading.Event:
    """For blocking (non-asyncio) commands, from the main thread: the first SIGTERM or SIGINT sets
    the returned flag, so the work in hand can finish; a second one raises KeyboardInterrupt (stop now)."""
    stopping = threading.Event()

    def on_signal(signum, _frame) -> None:
        if stopping.is_set():
            raise KeyboardInterrupt
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stopping
