"""One consume run's options beyond the stream's, checked once (parallel, poison, lost history)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from .._lanes import KeyFunction, Lanes, key_of, lanes_for
from .handler_errors import HandlerCalls, check_on_error
from .history import HistoryGap, HistoryPolicy

__all__ = ["DEFAULT_DRAIN_TIMEOUT", "OVERSIZE_CHOICES", "STARTS", "ConsumeOptions", "opener_arguments_error"]

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


OVERSIZE_CHOICES = ("fail", "split")
"""``consume(oversize=...)``: stop on an event over 16 MB, or let the server split it."""


STARTS = ("resume_after", "start_after", "start_at_operation_time")
"""``watch()`` options that say where a stream starts: in ``consume``'s ``watch_options``, where
the first run starts (the store holds no token yet); after that the stored token decides."""


def opener_arguments_error(
    is_collection: bool, initial_snapshot: bool, pipeline: Any, watch_options: Any,
    oversize: str = "fail",
) -> str | None:
    """Why ``consume``'s first argument does not fit the other arguments, or None."""
    if oversize not in OVERSIZE_CHOICES:
        return f"consume(): oversize must be 'fail' or 'split', not {oversize!r}"
    if is_collection:
        if watch_options is not None and not isinstance(watch_options, Mapping):
            return f"consume(): watch_options must be a dict, not {type(watch_options).__name__}"
        taken = [name for name in STARTS if name in (watch_options or {})]
        return None if not (taken and initial_snapshot) else (
            f"consume(initial_snapshot=True): watch_options must not hold {taken[0]!r}: the "
            "stream starts where the copy was read")
    if oversize == "split":
        return (
            "consume(oversize='split') needs the collection itself as its first argument "
            "(consume opens the stream); with an open_stream function, pass "
            "reassemble_split_events=True to watch() there"
        )
    if initial_snapshot:
        return (
            "consume(initial_snapshot=True) needs the collection itself as its first argument "
            "(consume opens the copy and the stream); pass watch() options as watch_options="
        )
    if pipeline is not None or watch_options is not None:
        return (
            "consume(): pipeline= and watch_options= apply only when the first argument is a "
            "collection; an open_stream function opens its own stream"
        )
    return None
