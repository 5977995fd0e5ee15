"""Progress reports of :func:`changestream.consume` (and its async twin), for callbacks and exporters.

``consume(..., on_stats=callback)`` calls ``callback(ConsumeStats)`` every
``stats_interval`` seconds, on a timer (a task of the loop for
``aio.consume``, a daemon thread for ``consume``: ``aio/_stats_timer.py``), so
reports keep coming while a poll or a reopen waits through an outage, and
once when the loop ends. The exporters
(:class:`changestream.exporters.prometheus.PrometheusExporter`,
:class:`changestream.exporters.opentelemetry.OpenTelemetryExporter`) are such
callbacks. A failing callback is logged and never stops the loop.

Without ``on_stats`` the same timer still runs (unless ``server_probes=False``): it
samples the lag every ``stats_interval`` seconds and, while the lag grows, reads the
oplog every :data:`~changestream._headroom.PROBE_EVERY` seconds, so the
time-to-history-loss WARNING (and the headroom's) comes in every ``consume``;
nothing is reported.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from ._headroom import HeadroomProbe
from ._position import Position
from ._server_metrics import HistoryLossEstimate, ServerMetricsProbe
from ._token import token_cluster_time

__all__ = ["COUNTERS", "ConsumeStats", "RunIncrements", "StatsCallback", "StatsReporter"]

log = logging.getLogger("changestream.consume")


@dataclasses.dataclass(frozen=True)
class ConsumeStats:
    """A snapshot of a running :func:`~changestream.consume` loop."""

    handled: int
    """Changes passed to the handler since the loop started."""
    events_per_second: float
    """Handled changes per second since the previous report."""
    lag: timedelta | None
    """How far the current stream is behind the server (see :attr:`ChangeStream.lag`)."""
    position: Position | None
    """The current stream's position (``None`` between streams)."""
    resumes: int
    """Automatic resumes of the streams (a resumable error or timeout, handled by the stream)."""
    reopens: int
    """Streams reopened by the loop after a failure the stream could not resume from."""
    stored: int
    """Tokens written to the store."""
    last_stored_token_time: datetime | None
    """Cluster time of the last stored token (UTC), ``None`` if none was stored or readable."""
    elapsed: float
    """Seconds since the loop started."""
    oplog_headroom: timedelta | None = None
    """Cluster time of the stream's token minus the oldest entry of a full oplog (``None``: the
    oplog is not full, so nothing is truncated yet, or it is not readable here, e.g. through
    mongos or without ``find``/``collStats`` on ``local``; see ``docs/consume.md``)."""
    final: bool = False
    """The loop has ended; this is its last report."""
    retries: int = 0
    """Handler calls repeated on the same change under the ``on_error`` policy."""
    dead_letters: int = 0
    """Changes ``on_error``'s ``dead_letter`` took (it returned; counted as handled)."""
    oplog_full: bool | None = None
    """Has the oplog reached its size limit (``None``: cannot tell)? Until it has, nothing is
    truncated and :attr:`oplog_headroom` is ``None``: "not full", not 0."""
    rescued: int = 0
    """Values a typed Delta sink put into its ``_rescued`` column (``on_mismatch="rescue"``);
    0 unless the sink fills it in: ``on_stats=sink.reporting(callback)`` (``mirror`` does)."""
    run_id: str = ""
    """Which ``consume`` call this report is from (a random id per call): the counts above
    start at 0 in each call, so a callback that accumulates them across calls (the exporters)
    tells one call's reports from another's by it."""
    history_lost_in: timedelta | None = None
    """Estimated time until the stored position falls off the oplog (history lost, 286): the
    :attr:`oplog_headroom` divided by how fast the lag grew over the last reports. ``None``:
    no headroom known (the oplog not full, or not readable) or the lag not growing."""
    server_large_events_split: int | None = None
    """The server's ``metrics.changeStreams.largeEventsSplit`` (events
    ``$changeStreamSplitLargeEvent`` split, since the server started; every stream of the
    server, not only this one). ``None``: ``serverStatus`` not readable here, or no such
    counter. Through mongos, mongos's own counter (see ``docs/consume.md``)."""
    server_large_events_failed: int | None = None
    """The server's ``metrics.changeStreams.largeEventsFailed`` (events too large to return)."""
    server_docs_examined_per_returned: float | None = None
    """Oplog entries the server's change-stream cursors examined per event returned, since
    the previous read (MongoDB 9.0+: ``cursor.docsExamined.sum / cursor.docsReturned.sum``);
    high means the streams filter out most of what they read."""


COUNTERS = ("handled", "resumes", "reopens", "stored", "retries", "dead_letters", "rescued")
"""The fields of :class:`ConsumeStats` that only grow during one run (the exporters' counters)."""


class RunIncrements:
    """What each counter grew by since the previous report of the same run.

    A process may call ``consume`` again (a restart, a second loop) with the same exporter:
    each run counts from 0, so a counter is the sum over runs of what each run reported,
    never ``now - before`` across runs (which undercounts a restarted loop). The previous
    report is kept per :attr:`ConsumeStats.run_id` and dropped at the run's final report.
    """

    def __init__(self) -> None:
        self._previous: dict[str, ConsumeStats] = {}
        self._lock = threading.Lock()

    def __call__(self, stats: ConsumeStats) -> dict[str, int]:
        """``{counter field: its increase since this run's previous report}`` (>= 0)."""
        with self._lock:
            before = self._previous.pop(stats.run_id, None)
            if not stats.final:
                self._previous[stats.run_id] = stats
        return {
            name: max(0, getattr(stats, name) - (0 if before is None else getattr(before, name)))
            for name in COUNTERS
        }


StatsCallback = Callable[[ConsumeStats], object]


class StatsReporter:
    """Counts for one consume loop and the schedule of its reports (shared by sync and async)."""

    def __init__(
        self,
        callback: StatsCallback | None,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        probes: bool = True,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
            raise ValueError(f"stats_interval must be a number of seconds > 0, not {interval!r}")
        if not isinstance(probes, bool):
            raise ValueError(f"server_probes must be True or False, not {probes!r}")
        self._callback = callback
        self.probes = probes
        """Read the deployment (oplog fill and oldest entry; ``serverStatus`` for the reports)
        every :data:`~changestream._headroom.PROBE_EVERY` seconds (``server_probes``)."""
        self._interval = float(interval)
        self._clock = clock
        self._started = self._last_report = clock()
        self._run_id = uuid.uuid4().hex
        self._handled_at_last_report = 0
        self._stream: Any = None
        self._resumes_before = 0
        """Resumes of the streams before the current one."""
        self.stored = 0
        self.last_stored_token_time: datetime | None = None
        self.calls: Any = None
        """The run's :class:`~changestream._consumer.handler_errors.HandlerCalls` (retry and dead-letter counts)."""
        self.headroom = HeadroomProbe()
        """Reads of the oldest oplog entry (done by the stats timer)."""
        self.server = ServerMetricsProbe()
        """Reads of ``serverStatus().metrics.changeStreams`` (done by the stats timer)."""
        self.history = HistoryLossEstimate()
        """The time to history loss, from the headroom and the lag's trend."""
        self.timer: Any = None
        """The running stats timer (a task or a thread), ``None`` before it starts."""
        self.ended = False
        """The final report was made: the timer stops."""
        self.ending = threading.Event()
        """Set with :attr:`ended`: wakes the sync timer's wait, so it ends at once."""
        self._lock = threading.Lock()
        """The timer thread and the loop may both report (sync ``consume``)."""

    @property
    def reporting(self) -> bool:
        """A callback is set: reports are wanted."""
        return self._callback is not None

    @property
    def wanted(self) -> bool:
        """The timer has work: reports, or (without a callback) the samples of the lag that the
        time to history loss and its warning come from, while the oplog may be readable."""
        if self._callback is not None:
            return True
        return self.probes and self.headroom.unavailable is None

    @property
    def reading_oplog(self) -> bool:
        """Read the oplog (when due)? With a callback, always: the headroom is reported.
        Without, only while the lag grows: only then can history loss near, and a consumer
        that keeps up costs no read."""
        if not self.probes:
            return False
        return self._callback is not None or self.history.growing

    def due_in(self) -> float:
        """Seconds until the next report is due (0: now)."""
        return max(0.0, self._interval - (self._clock() - self._last_report))

    @property
    def stream(self) -> Any:
        """The current stream (``None`` before the first opens)."""
        return self._stream

    def on_stream(self, stream: Any) -> None:
        """A new stream was opened (its predecessor's resumes are kept)."""
        if self._stream is not None:
            self._resumes_before += self._stream.resumes
        self._stream = stream

    def on_stored(self, token: Any) -> None:
        self.stored += 1
        cluster_time = None if token is None else token_cluster_time(token)
        if cluster_time is not None:
            self.last_stored_token_time = cluster_time.as_datetime()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("stored the resume token (cluster time %s)", cluster_time)

    def poll(self, handled: int, reopens: int) -> None:
        """After each poll and on each timer tick: report if ``interval`` seconds have passed."""
        if self._callback is not None and self._clock() - self._last_report >= self._interval:
            self._report(handled, reopens, final=False)

    def tick(self, handled: int, reopens: int) -> None:
        """On each timer tick: report if ``interval`` seconds have passed; without a callback
        only sample (the lag's trend, the headroom and history-loss warnings)."""
        if self._clock() - self._last_report >= self._interval:
            self._report(handled, reopens, final=False)

    def finish(self, handled: int, reopens: int) -> None:
        """The loop ended (returned or raised): the last report; the timer stops."""
        if self._callback is not None:
            self._report(handled, reopens, final=True)
        self.ended = True
        self.ending.set()

    def snapshot(self, handled: int, reopens: int, *, final: bool = False) -> ConsumeStats:
        now = self._clock()
        seconds = now - self._last_report
        rate = (handled - self._handled_at_last_report) / seconds if seconds > 0 else 0.0
        stream = self._stream
        position = None if stream is None else stream.position
        resumes = self._resumes_before + (0 if stream is None else stream.resumes)
        lag = None if position is None else position.lag
        headroom = self.headroom.headroom(position)
        server = self.server.latest
        return ConsumeStats(
            handled=handled,
            events_per_second=rate,
            lag=lag,
            position=position,
            resumes=resumes,
            reopens=reopens,
            stored=self.stored,
            last_stored_token_time=self.last_stored_token_time,
            elapsed=now - self._started,
            oplog_headroom=headroom,
            final=final,
            retries=0 if self.calls is None else self.calls.retries,
            dead_letters=0 if self.calls is None else self.calls.dead_letters,
            run_id=self._run_id,
            oplog_full=self.headroom.full,
            history_lost_in=self.history.update(now, lag, headroom),
            server_large_events_split=None if server is None else server.large_events_split,
            server_large_events_failed=None if server is None else server.large_events_failed,
            server_docs_examined_per_returned=self.server.examined_per_returned,
        )

    def _report(self, handled: int, reopens: int, *, final: bool) -> None:
        with self._lock:
            if self.ended:
                return  # the timer lost the race with the final report
            if not final and self._clock() - self._last_report < self._interval:
                return  # the loop and the timer were both due: one report
            stats = self.snapshot(handled, reopens, final=final)
            self._last_report = self._clock()
            self._handled_at_last_report = handled
            if final:
                self.ended = True
            if self._callback is None:
                return  # a sample: the snapshot updated the estimate and its warnings
            try:
                self._callback(stats)
            except Exception:
                log.exception("the on_stats callback failed (ignored)")
