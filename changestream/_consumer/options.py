"""One consume run's options beyond the stream's, checked once (parallel, poison, lost history)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final

from .._lanes import KeyFunction, Lanes, key_of, lanes_for
from .handler_errors import HandlerCalls, check_on_error
from .history import HistoryGap, HistoryPolicy

__all__ = ["DEFAULT_DRAIN_TIMEOUT", "ConsumeOptions"]

DEFAULT_DRAIN_TIMEOUT: Final = 30.0
"""Seconds ``consume`` lets admitted changes finish after a stop, Ctrl-C or an error (workers > 1)."""


class ConsumeOptions:
    """The parallel, poison and lost-history options of one consume run, checked once.

    Shared by :func:`changestream.consume` and :func:`changestream.aio.consume`:
    ``source`` is their first argument, ``opener`` what
    :func:`~changestream._snapshot_watch.stream_opener` made of it (``source``
    itself unless it is a collection).
    """

    def __init__(
        self,
        source: object,
        opener: object,
        *,
        workers: object,
        key: KeyFunction | None,
        max_in_flight: object,
        drain_timeout: object,
        on_error: object,
        on_history_lost: object,
        gap: Callable[[HistoryGap], Any] | None,
    ) -> None:
        self.lanes: Lanes | None = lanes_for(workers, max_in_flight)
        """The dispatcher (``None``: ``workers=1``, the sequential loop)."""
        self.key = key_of(key)
        if (isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float))
                or not math.isfinite(drain_timeout) or drain_timeout < 0):
            raise ValueError(f"drain_timeout must be a number of seconds >= 0, not {drain_timeout!r}")
        self.drain_timeout = float(drain_timeout)
        self.calls = HandlerCalls(check_on_error(on_error))
        self.history = HistoryPolicy(on_history_lost, gap, is_collection=opener is not source)
        self.resnapshot = on_history_lost == "resnapshot"

    def report_gap(self, gap: HistoryGap | None) -> Any:
        """Call the ``gap`` function (its result: awaited by the async loop if awaitable)."""
        assert gap is not None and self.history.gap is not None
        return self.history.gap(gap)
