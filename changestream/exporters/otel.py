"""OpenTelemetry metrics for a :func:`changestream.consume` loop (``pip install "changestream[opentelemetry]"``).

::

    from changestream.exporters.otel import OpenTelemetryExporter

    changestream.consume(open_stream, handle, store,
                         on_stats=OpenTelemetryExporter(attributes={"stream": "orders"}))

Instruments are created on the meter given, else on
``opentelemetry.metrics.get_meter("changestream")`` (the global meter
provider: configure the SDK and its exporter as usual). The same names as the
Prometheus exporter, dotted: ``changestream.events.handled``,
``changestream.resumes``, ``changestream.reopens``, ``changestream.tokens.stored``,
``changestream.handler.retries``, ``changestream.dead_letters``,
``changestream.values.rescued`` (counters, monotonic for the life of the process: an exporter reused by a later ``consume`` call adds that
call's counts); ``changestream.events.rate`` (events/s), ``changestream.lag``
(seconds), ``changestream.oplog.headroom`` (seconds; absent where it cannot be
read), ``changestream.history_lost_in`` (seconds until the stored position falls off the
oplog; absent while there is no estimate), ``changestream.server.large_events.split``,
``changestream.server.large_events.failed`` and
``changestream.server.docs_examined_per_returned`` (the server's
``serverStatus().metrics.changeStreams``; absent where it cannot be read),
``changestream.last_stored_token.timestamp`` (Unix seconds)
(observable gauges reporting the latest stats).

Several loops in one process export side by side: the exporters of one meter
share its instruments (created once; the gauges' callbacks report every
exporter's latest stats), and ``attributes`` (e.g. ``{"stream": "orders"}``)
tell them apart.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

try:
    from opentelemetry import metrics
    from opentelemetry.metrics import CallbackOptions, Counter, Meter, Observation
except ImportError as exc:  # one clear error instead of a bare ModuleNotFoundError
    raise ImportError(
        "changestream.exporters.otel needs the 'opentelemetry' extra: "
        f"pip install 'changestream[opentelemetry]' ({exc})"
    ) from exc

from .._metrics import ConsumeStats, RunIncrements

__all__ = ["OpenTelemetryExporter"]


class _Instruments:
    """One meter's instruments, shared by its exporters (a meter warns on a second creation
    and keeps the first callback only)."""

    def __init__(self, meter: Meter) -> None:
        self.exporters: list[OpenTelemetryExporter] = []
        self.handled = meter.create_counter(
            "changestream.events.handled", unit="{event}", description="Changes handled"
        )
        self.resumes = meter.create_counter(
            "changestream.resumes", unit="{resume}", description="Automatic stream resumes"
        )
        self.reopens = meter.create_counter(
            "changestream.reopens", unit="{reopen}", description="Streams reopened by the loop"
        )
        self.stored = meter.create_counter(
            "changestream.tokens.stored", unit="{token}", description="Tokens stored"
        )
        self.counters: dict[str, Counter] = {
            "handled": self.handled, "resumes": self.resumes, "reopens": self.reopens,
            "stored": self.stored,
            "retries": meter.create_counter(
                "changestream.handler.retries", unit="{call}",
                description="Handler calls repeated on the same change (on_error)"),
            "dead_letters": meter.create_counter(
                "changestream.dead_letters", unit="{event}",
                description="Changes on_error's dead_letter took"),
            "rescued": meter.create_counter(
                "changestream.values.rescued", unit="{value}",
                description="Values a Delta sink put into its _rescued column"),
        }
        """The counter of each :data:`~changestream._metrics.COUNTERS` field."""
        for name, read, unit, description in (
            ("changestream.events.rate", lambda s: s.events_per_second, "{event}/s",
             "Handled changes per second (last interval)"),
            ("changestream.lag", lambda s: None if s.lag is None else s.lag.total_seconds(),
             "s", "How far behind the change stream is"),
            ("changestream.oplog.headroom",
             lambda s: None if s.oplog_headroom is None else s.oplog_headroom.total_seconds(),
             "s", "Token cluster time minus the oldest oplog entry's"),
            ("changestream.history_lost_in",
             lambda s: None if s.history_lost_in is None else s.history_lost_in.total_seconds(),
             "s", "Estimated time until the stored position falls off the oplog"),
            ("changestream.server.large_events.split", lambda s: s.server_large_events_split,
             "{event}", "The server's metrics.changeStreams.largeEventsSplit"),
            ("changestream.server.large_events.failed", lambda s: s.server_large_events_failed,
             "{event}", "The server's metrics.changeStreams.largeEventsFailed"),
            ("changestream.server.docs_examined_per_returned",
             lambda s: s.server_docs_examined_per_returned, "1",
             "Oplog entries the server's change streams examined per event returned"),
            ("changestream.last_stored_token.timestamp",
             lambda s: None if s.last_stored_token_time is None
             else s.last_stored_token_time.timestamp(),
             "s", "Cluster time of the last stored token (Unix seconds)"),
        ):
            meter.create_observable_gauge(name, [self._observer(read)], unit=unit,
                                          description=description)

    def _observer(
        self, read: Callable[[ConsumeStats], float | None]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            for exporter in list(self.exporters):
                latest = exporter._latest
                value = None if latest is None else read(latest)
                if value is not None:
                    yield Observation(value, exporter._attributes)
        return observe


_INSTRUMENTS: weakref.WeakKeyDictionary[Any, _Instruments] = weakref.WeakKeyDictionary()
"""Per meter (held weakly), its instruments: how a second exporter finds the first's."""
_LOCK = threading.Lock()


class OpenTelemetryExporter:
    """An ``on_stats`` callback that records OpenTelemetry metrics (see the module docstring)."""

    def __init__(
        self,
        meter: Meter | None = None,
        attributes: Mapping[str, str] | None = None,
    ) -> None:
        meter = metrics.get_meter("changestream") if meter is None else meter
        self._attributes = dict(attributes or {})
        self._latest: ConsumeStats | None = None
        self._increments = RunIncrements()
        with _LOCK:
            instruments = _INSTRUMENTS.get(meter)
            if instruments is None:
                instruments = _INSTRUMENTS[meter] = _Instruments(meter)
            instruments.exporters.append(self)
        self._instruments = instruments

    def __call__(self, stats: ConsumeStats) -> None:
        counters = self._instruments.counters
        for name, increase in self._increments(stats).items():
            if increase:
                counters[name].add(increase, self._attributes)
        self._latest = stats
