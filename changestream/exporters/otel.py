"""OpenTelemetry metrics for a :func:`changestream.consume` loop (``pip install "changestream[opentelemetry]"``).

::

    from changestream.exporters.otel import OpenTelemetryExporter

    changestream.consume(open_stream, handle, store,
                         on_stats=OpenTelemetryExporter(attributes={"stream": "orders"}))

Instruments are created on the meter given, else on
``opentelemetry.metrics.get_meter("changestream")`` (the global meter
provider: configure the SDK and its exporter as usual). The same names as the
Prometheus exporter, dotted: ``changestream.events.handled``,
``changestream.resumes``, ``changestream.reopens``, ``changestream.tokens.stored``
(counters); ``changestream.events.rate`` (events/s), ``changestream.lag``
(seconds), ``changestream.last_stored_token.timestamp`` (Unix seconds)
(observable gauges reporting the latest stats).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from .._metrics import ConsumeStats

__all__ = ["OpenTelemetryExporter"]


class OpenTelemetryExporter:
    """An ``on_stats`` callback that records OpenTelemetry metrics (see the module docstring)."""

    def __init__(
        self,
        meter: Meter | None = None,
        attributes: Mapping[str, str] | None = None,
    ) -> None:
        meter = metrics.get_meter("changestream") if meter is None else meter
        self._attributes = dict(attributes or {})
        self._handled = meter.create_counter(
            "changestream.events.handled", unit="{event}", description="Changes handled"
        )
        self._resumes = meter.create_counter(
            "changestream.resumes", unit="{resume}", description="Automatic stream resumes"
        )
        self._reopens = meter.create_counter(
            "changestream.reopens", unit="{reopen}", description="Streams reopened by the loop"
        )
        self._stored = meter.create_counter(
            "changestream.tokens.stored", unit="{token}", description="Tokens stored"
        )
        self._latest: ConsumeStats | None = None
        meter.create_observable_gauge(
            "changestream.events.rate", [self._observe_rate], unit="{event}/s",
            description="Handled changes per second (last interval)",
        )
        meter.create_observable_gauge(
            "changestream.lag", [self._observe_lag], unit="s",
            description="Server cluster time minus the stream's token time",
        )
        meter.create_observable_gauge(
            "changestream.last_stored_token.timestamp", [self._observe_stored_time], unit="s",
            description="Cluster time of the last stored token (Unix seconds)",
        )

    def __call__(self, stats: ConsumeStats) -> None:
        before = self._latest
        for counter, now, was in (
            (self._handled, stats.handled, 0 if before is None else before.handled),
            (self._resumes, stats.resumes, 0 if before is None else before.resumes),
            (self._reopens, stats.reopens, 0 if before is None else before.reopens),
            (self._stored, stats.stored, 0 if before is None else before.stored),
        ):
            if now > was:
                counter.add(now - was, self._attributes)
        self._latest = stats

    def _observe_rate(self, options: CallbackOptions) -> Iterable[Observation]:
        if self._latest is not None:
            yield Observation(self._latest.events_per_second, self._attributes)

    def _observe_lag(self, options: CallbackOptions) -> Iterable[Observation]:
        if self._latest is not None and self._latest.lag is not None:
            yield Observation(self._latest.lag.total_seconds(), self._attributes)

    def _observe_stored_time(self, options: CallbackOptions) -> Iterable[Observation]:
        stats = self._latest
        if stats is not None and stats.last_stored_token_time is not None:
            yield Observation(stats.last_stored_token_time.timestamp(), self._attributes)
