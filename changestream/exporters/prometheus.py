"""Prometheus metrics for a :func:`changestream.consume` loop (``pip install "changestream[prometheus]"``).

::

    from prometheus_client import start_http_server
    from changestream.exporters.prometheus import PrometheusExporter

    start_http_server(9108)
    changestream.consume(open_stream, handle, store, on_stats=PrometheusExporter(stream="orders"))

Metrics (``namespace`` prefix, default ``changestream``; every one carries the
labels given as keyword arguments):

============================================  =======  ==============================================
name                                          type     meaning
============================================  =======  ==============================================
``changestream_events_handled_total``         counter  changes passed to the handler
``changestream_events_per_second``            gauge    handled changes per second, last interval
``changestream_lag_seconds``                  gauge    server time minus the stream's token time
``changestream_resumes_total``                counter  automatic resumes inside the stream
``changestream_reopens_total``                counter  streams reopened by the loop
``changestream_tokens_stored_total``          counter  tokens written to the store
``changestream_last_stored_token_timestamp``  gauge    cluster time of the last stored token (Unix s)
============================================  =======  ==============================================
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from .._metrics import ConsumeStats

__all__ = ["PrometheusExporter"]


class PrometheusExporter:
    """An ``on_stats`` callback that updates Prometheus metrics (see the module docstring)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        namespace: str = "changestream",
        **labels: str,
    ) -> None:
        registry = REGISTRY if registry is None else registry
        names = sorted(labels)
        self._labels = labels

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, namespace=namespace, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, namespace=namespace, registry=registry)

        self._handled = counter("events_handled", "Changes passed to the handler")
        self._rate = gauge("events_per_second", "Handled changes per second (last interval)")
        self._lag = gauge("lag_seconds", "Server cluster time minus the stream's token time")
        self._resumes = counter("resumes", "Automatic resumes inside the change stream")
        self._reopens = counter("reopens", "Change streams reopened by the consume loop")
        self._stored = counter("tokens_stored", "Resume tokens written to the store")
        self._stored_time = gauge(
            "last_stored_token_timestamp", "Cluster time of the last stored token (Unix seconds)"
        )
        self._seen = ConsumeStats(0, 0.0, None, None, 0, 0, 0, None, 0.0)
        for total in (self._handled, self._resumes, self._reopens, self._stored):
            total.labels(**labels)  # exported as 0 from the start, not absent

    def __call__(self, stats: ConsumeStats) -> None:
        labels = self._labels
        seen = self._seen
        # Counters only go up: add what happened since the previous report.
        for metric, now, before in (
            (self._handled, stats.handled, seen.handled),
            (self._resumes, stats.resumes, seen.resumes),
            (self._reopens, stats.reopens, seen.reopens),
            (self._stored, stats.stored, seen.stored),
        ):
            if now > before:
                metric.labels(**labels).inc(now - before)
        self._rate.labels(**labels).set(stats.events_per_second)
        if stats.lag is not None:
            self._lag.labels(**labels).set(stats.lag.total_seconds())
        if stats.last_stored_token_time is not None:
            self._stored_time.labels(**labels).set(stats.last_stored_token_time.timestamp())
        self._seen = stats
