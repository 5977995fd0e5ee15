"""The status line of ``watch`` and ``mirror``, ``--until-idle``, and ``--start-at-operation-time``.

The status line (events, rate, lag) is redrawn on stderr about once a second
when stderr is a terminal; log records and messages clear it first, so the two
never mix on one line. Both it and the ``--until-idle`` check ride on the
consume loop's ``on_stats`` reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import IO

from bson.timestamp import Timestamp

from .. import ConsumeStats

__all__ = ["StatusLine", "WatchProgress", "parse_operation_time"]

REFRESH = 1.0
"""Seconds between status line updates."""


def parse_operation_time(text: str) -> Timestamp:
    """``--start-at-operation-time``: ``SECONDS``, ``SECONDS:INCREMENT`` or an ISO-8601 time.

    A naive ISO time is UTC. Raises ``ValueError`` naming the accepted forms.
    """
    value = text.strip()
    seconds, _, increment = value.partition(":")
    if seconds.isdigit() and (increment.isdigit() or not increment) and not value.count(":") > 1:
        return Timestamp(int(seconds), int(increment or 0))
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text!r} is not a cluster time: use SECONDS, SECONDS:INCREMENT (a BSON "
            "timestamp) or an ISO-8601 time such as 2026-11-26T02:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return Timestamp(int(when.timestamp()), 0)


def _format_lag(stats: ConsumeStats) -> str:
    if stats.lag is None:
        return "lag ?"
    seconds = int(stats.lag.total_seconds())
    if seconds < 120:
        return f"lag {seconds} s"
    if seconds < 7200:
        return f"lag {seconds // 60} min"
    return f"lag {seconds / 3600:.1f} h"


class StatusLine:
    """One line on a terminal, redrawn in place; :meth:`clear` before printing anything else."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._shown = False
        self._lock = threading.Lock()

    def show(self, stats: ConsumeStats, rate: float, extra: str = "") -> None:
        text = (
            f"{stats.handled} events  {rate:.1f}/s  {_format_lag(stats)}"
            f"  resumes {stats.resumes + stats.reopens}"
        )
        if extra:
            text += f"  {extra}"
        with self._lock:
            self._stream.write(f"\r\x1b[K{text}")
            self._stream.flush()
            self._shown = True

    def clear(self) -> None:
        with self._lock:
            if self._shown:
                self._stream.write("\r\x1b[K")
                self._stream.flush()
                self._shown = False


class _ClearFirst(logging.Filter):
    """Clears the status line before a log record is written under it."""

    def __init__(self, status: StatusLine) -> None:
        super().__init__()
        self._status = status

    def filter(self, record: logging.LogRecord) -> bool:
        self._status.clear()
        return True


class WatchProgress:
    """The ``on_stats`` callback of ``changestream watch``: status line and idle stop."""

    def __init__(
        self,
        stop: threading.Event,
        status: StatusLine | None,
        until_idle: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stop = stop
        self._status = status
        self._until_idle = until_idle
        self._clock = clock
        self._handled = 0
        self._last_change = clock()
        self._last_draw: float | None = None
        self._drawn_handled = 0
        self.idle_stop = False
        """``True`` once ``--until-idle`` ended the run."""
        self.extra: Callable[[], str] | None = None
        """More of the status line (``mirror``: a re-snapshot's progress)."""
        self.busy: Callable[[], bool] | None = None
        """``--until-idle`` waits while this says so (``mirror``: a re-snapshot runs)."""
        self.caught_up_to: Timestamp | None = None
        """The deployment's cluster time when the command started: ``--until-idle`` waits until
        the stream's token has reached it (never during a snapshot or a backlog)."""

    @property
    def interval(self) -> float:
        """How often the consume loop should report (the idle check needs finer steps)."""
        if self._until_idle is None:
            return REFRESH
        return max(0.05, min(REFRESH, self._until_idle / 4))

    def attach(self, handler: logging.Handler) -> None:
        """Clear the status line before ``handler`` writes a record."""
        if self._status is not None:
            handler.addFilter(_ClearFirst(self._status))

    def __call__(self, stats: ConsumeStats) -> None:
        now = self._clock()
        if stats.handled != self._handled:
            self._handled = stats.handled
            self._last_change = now
        if self._status is not None:
            if stats.final:
                self._status.clear()
            elif self._last_draw is None:
                self._status.show(stats, stats.events_per_second, self._extra())
                self._last_draw, self._drawn_handled = now, stats.handled
            elif now - self._last_draw >= REFRESH * 0.9:
                rate = (stats.handled - self._drawn_handled) / (now - self._last_draw)
                self._status.show(stats, rate, self._extra())
                self._last_draw, self._drawn_handled = now, stats.handled
        if (
            self._until_idle is not None
            and not stats.final
            and now - self._last_change >= self._until_idle
            and self._caught_up(stats)
            and not (self.busy is not None and self.busy())
        ):
            self.idle_stop = True
            self._stop.set()

    def _extra(self) -> str:
        return "" if self.extra is None else self.extra()

    def _caught_up(self, stats: ConsumeStats) -> bool:
        """The stream's token has reached the cluster time read at the start (a snapshot's
        records and a backlog have not: their position is none, or older)."""
        if self.caught_up_to is None:
            return True
        position = stats.position
        reached = None if position is None else position.token_time
        return reached is not None and reached >= self.caught_up_to

    def clear(self) -> None:
        if self._status is not None:
            self._status.clear()
