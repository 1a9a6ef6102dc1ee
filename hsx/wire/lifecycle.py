"""Graceful shutdown: a signal sets an event; services stop fetching, finish in-flight work
within their deadline, then drain their NATS connection.

The first SIGTERM or SIGINT is said at once (`stopping`, with what the worker is finishing: its
`in_hand()`), since finishing may take seconds; a second one stops now (`stopping_now`): the
worker's last words (its goodbye heartbeat) get a second, then the process exits STOPPED (75,
hsx/exitcodes.py), its work in hand unacked, which JetStream redelivers after the ack wait: safe
to run again, as after the first.
"""

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable

from hsx.exitcodes import STOPPED
from hsx.logs import get_logger

log = get_logger("hsx.lifecycle")

# How long a second signal leaves the last words (a goodbye heartbeat) before the process exits.
LAST_WORDS_S = 1.0


class StopEvent(asyncio.Event):
    """Set by the first SIGTERM or SIGINT (or by the worker itself: its job done or lost).

    `in_hand()` says what the worker is finishing, as the fields of the `stopping` event (a batch
    id, the uploads in flight); `last_words()` is awaited, for up to LAST_WORDS_S, before a second
    signal ends the process. The worker sets both once it has something to say."""

    def __init__(self) -> None:
        super().__init__()
        self.in_hand: Callable[[], dict] = dict
        self.last_words: Callable[[], Awaitable[None]] | None = None
        self.signals = 0

    def _said(self) -> dict:
        try:
            return self.in_hand()
        except Exception as exc:  # what is in hand is a courtesy; stopping is not
            return {"in_hand_unknown": str(exc) or type(exc).__name__}

    def on_signal(self, signum: int) -> None:
        """A signal's handler, in the running loop."""
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals == 1:
            log.info("stopping", signal=name, **self._said(), then="a second signal stops now, leaving it unacked")
            self.set()
            return
        if self.signals == 2:
            log.warning("stopping_now", signal=name, **self._said(), left="unacked, redelivered after the ack wait")
            asyncio.get_running_loop().create_task(self._exit(STOPPED))
            return
        exit_now(STOPPED)  # a third: the last words took too long

    async def _exit(self, code: int) -> None:
        if self.last_words is not None:
            try:
                await asyncio.wait_for(self.last_words(), timeout=LAST_WORDS_S)
            except Exception:  # noqa: BLE001 - the process ends anyway
                pass
        exit_now(code)


def exit_now(code: int) -> None:
    """End the process at once: no thread (a forward, a file write) is waited for."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting regardless
            pass
    os._exit(code)


def stop_event_on_signals() -> StopEvent:
    """SIGTERM and SIGINT: the first sets the returned event, a second stops now; call inside the
    running loop."""
    stopping = StopEvent()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.on_signal, sig)
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
