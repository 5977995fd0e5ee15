"""What bounds a consume run from outside: each stream call's timeout, and stop signals."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pymongo

__all__ = ["DEFAULT_CALL_TIMEOUT", "call_bound", "check_call_timeout", "signals_stop"]

log = logging.getLogger("changestream.consume")

DEFAULT_CALL_TIMEOUT = 60.0
"""Seconds each stream call (open, poll, close) of :func:`consume` may take by default."""


def check_call_timeout(call_timeout: float) -> None:
    if (
        isinstance(call_timeout, bool)
        or not isinstance(call_timeout, (int, float))
        or not math.isfinite(call_timeout)
        or not 0 < call_timeout <= 86400
    ):
        raise ValueError(
            f"call_timeout must be a number of seconds in (0, 86400], not {call_timeout!r}"
        )


@contextlib.contextmanager
def signals_stop(enabled: bool, set_stop: Callable[[], object]) -> Iterator[None]:
    """With ``enabled``, SIGTERM and SIGINT call ``set_stop`` instead of killing the process.

    Python delivers signals to the main thread only, so this needs it; the
    previous handlers come back when the block ends.
    """
    if not enabled:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("stop_on_signals=True needs the main thread (signals arrive there)")

    def handler(signum: int, frame: FrameType | None) -> None:
        log.warning("received %s: stopping after the current change", signal.Signals(signum).name)
        set_stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def call_bound(call_timeout: float) -> contextlib.AbstractContextManager[Any]:
    """The client-side timeout around one poll that may do I/O (a change stream, or the
    initial-snapshot wrapper, whose copy getMores go without ``maxTimeMS``:
    :func:`changestream._pymongo.plain_command_spec`). The loop polls a stream's buffer
    (two or more changes waiting) without it: no I/O, and it runs per change."""
    return pymongo.timeout(call_timeout)
