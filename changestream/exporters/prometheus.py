"""Prometheus metrics for :func:`changestream.consume` loops (``pip install "changestream[prometheus]"``).

::

    from changestream.exporters.prometheus import PrometheusExporter, serve

    serve(9108)                     # http://127.0.0.1:9108/metrics (loopback unless addr= says otherwise)
    changestream.consume(open_orders, handle, store, on_stats=PrometheusExporter(stream="orders"))

Several loops in one process export side by side: every exporter of a registry
and namespace shares one metric family per name, and the keyword arguments
are the labels that tell the loops apart (``PrometheusExporter(stream="orders")``,
``PrometheusExporter(stream="users")``). All exporters of a family must use the
same label names (else one ``ValueError`` says which); two exporters with the
same label values count into the same series (use one per loop).

The counters are monotonic for the life of the process: an exporter reused by a
later ``consume`` call (a restart of the loop) adds that call's counts to what the
earlier calls reported (each call counts from 0; :attr:`ConsumeStats.run_id` tells
them apart).

Metrics (``namespace`` prefix, default ``changestream``; every one carries the
labels given as keyword arguments):

==================================================  =======  ==============================================
name                                                type     meaning
==================================================  =======  ==============================================
``changestream_events_handled_total``               counter  changes passed to the handler
``changestream_events_per_second``                  gauge    handled changes per second, last interval
``changestream_lag_seconds``                        gauge    how far behind the stream is
                                                             (``ConsumeStats.lag``)
``changestream_oplog_headroom_seconds``             gauge    token time minus the oldest oplog entry
                                                             (absent where it cannot be read)
``changestream_history_lost_in_seconds``            gauge    estimated time until the stored position falls
                                                             off the oplog
                                                             (``ConsumeStats.history_lost_in``; absent
                                                             while there is no estimate)
``changestream_server_large_events_split``          gauge    the server's
                                                             ``metrics.changeStreams.largeEventsSplit``
                                                             (absent where ``serverStatus`` cannot be read)
``changestream_server_large_events_failed``         gauge    the server's ``largeEventsFailed``
``changestream_server_docs_examined_per_returned``  gauge    oplog entries examined per event returned
                                                             (9.0+; since the previous read)
``changestream_resumes_total``                      counter  automatic resumes inside the stream
``changestream_reopens_total``                      counter  streams reopened by the loop
``changestream_tokens_stored_total``                counter  tokens written to the store
``changestream_handler_retries_total``              counter  handler calls repeated under ``on_error``
``changestream_dead_letters_total``                 counter  changes ``on_error``'s ``dead_letter`` took
``changestream_values_rescued_total``               counter  values a Delta sink put into ``_rescued``
                                                             (``on_stats=sink.reporting(exporter)``)
``changestream_last_stored_token_timestamp``        gauge    cluster time of the last stored token (Unix s)
==================================================  =======  ==============================================
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

try:
    import prometheus_client
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
except ImportError as exc:  # one clear error instead of a bare ModuleNotFoundError
    raise ImportError(
        "changestream.exporters.prometheus needs the 'prometheus' extra: "
        f"pip install 'changestream[prometheus]' ({exc})"
    ) from exc

from .._metrics import ConsumeStats, RunIncrements

__all__ = ["PrometheusExporter", "serve"]


@dataclasses.dataclass(frozen=True)
class _Family:
    """The metrics of one registry and namespace, shared by its exporters."""

    labels: tuple[str, ...]
    handled: Counter
    rate: Gauge
    lag: Gauge
    headroom: Gauge
    history_lost_in: Gauge
    server_split: Gauge
    server_failed: Gauge
    server_examined: Gauge
    resumes: Counter
    reopens: Counter
    stored: Counter
    retries: Counter
    dead_letters: Counter
    rescued: Counter
    stored_time: Gauge

    def counters(self) -> dict[str, Counter]:
        """The counter of each :data:`~changestream._metrics.COUNTERS` field."""
        return {"handled": self.handled, "resumes": self.resumes, "reopens": self.reopens,
                "stored": self.stored, "retries": self.retries,
                "dead_letters": self.dead_letters, "rescued": self.rescued}


_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, _Family]] = (
    weakref.WeakKeyDictionary()
)
"""Per registry (held weakly: it lives as long as the registry does), the families by namespace.
A registry accepts each metric name once; this is how a second exporter finds the first's."""
_LOCK = threading.Lock()


def _family(registry: CollectorRegistry, namespace: str, labels: tuple[str, ...]) -> _Family:
    with _LOCK:
        families = _FAMILIES.setdefault(registry, {})
        family = families.get(namespace)
        if family is not None:
            if family.labels != labels:
                raise ValueError(
                    f"the {namespace!r} metrics of this registry have the labels "
                    f"{list(family.labels)}, not {list(labels)}: give every PrometheusExporter "
                    f"of one registry the same label names (e.g. stream=...), or another "
                    f"namespace"
                )
            return family

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, namespace=namespace, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, namespace=namespace, registry=registry)

        family = _Family(
            labels,
            handled=counter("events_handled", "Changes passed to the handler"),
            rate=gauge("events_per_second", "Handled changes per second (last interval)"),
            lag=gauge("lag_seconds", "How far behind the change stream is (seconds)"),
            headroom=gauge(
                "oplog_headroom_seconds", "Token cluster time minus the oldest oplog entry's"
            ),
            history_lost_in=gauge(
                "history_lost_in_seconds",
                "Estimated seconds until the stored position falls off the oplog",
            ),
            server_split=gauge("server_large_events_split",
                               "The server's metrics.changeStreams.largeEventsSplit"),
            server_failed=gauge("server_large_events_failed",
                                "The server's metrics.changeStreams.largeEventsFailed"),
            server_examined=gauge("server_docs_examined_per_returned",
                                  "Oplog entries the server's change streams examined per "
                                  "event returned (since the previous read)"),
            resumes=counter("resumes", "Automatic resumes inside the change stream"),
            reopens=counter("reopens", "Change streams reopened by the consume loop"),
            stored=counter("tokens_stored", "Resume tokens written to the store"),
            retries=counter("handler_retries",
                            "Handler calls repeated on the same change (on_error)"),
            dead_letters=counter("dead_letters", "Changes on_error's dead_letter took"),
            rescued=counter("values_rescued",
                            "Values a Delta sink put into its _rescued column"),
            stored_time=gauge(
                "last_stored_token_timestamp",
                "Cluster time of the last stored token (Unix seconds)",
            ),
        )
        families[namespace] = family
        return family


def serve(
    port: int = 9108, addr: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY
) -> Any:
    """Serve ``/metrics`` over HTTP on ``addr:port``: loopback unless ``addr`` says otherwise.

    ``prometheus_client.start_http_server`` listens on every interface by
    default; a metrics endpoint open to the network is a choice to make
    explicitly (``addr="0.0.0.0"``). Returns what ``start_http_server`` returns.
    """
    return prometheus_client.start_http_server(port, addr=addr, registry=registry)


class PrometheusExporter:
    """An ``on_stats`` callback that updates Prometheus metrics (see the module docstring)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        namespace: str = "changestream",
        **labels: str,
    ) -> None:
        registry = REGISTRY if registry is None else registry
        self._family = family = _family(registry, namespace, tuple(sorted(labels)))
        self._labels = labels
        self._increments = RunIncrements()
        self._counters = family.counters()
        for total in self._counters.values():
            total.labels(**labels)  # exported as 0 from the start, not absent

    def __call__(self, stats: ConsumeStats) -> None:
        labels = self._labels
        family = self._family
        # Counters only go up: add what happened since this run's previous report.
        for name, increase in self._increments(stats).items():
            if increase:
                self._counters[name].labels(**labels).inc(increase)
        family.rate.labels(**labels).set(stats.events_per_second)
        if stats.lag is not None:
            family.lag.labels(**labels).set(stats.lag.total_seconds())
        if stats.oplog_headroom is not None:
            family.headroom.labels(**labels).set(stats.oplog_headroom.total_seconds())
        if stats.history_lost_in is not None:
            family.history_lost_in.labels(**labels).set(stats.history_lost_in.total_seconds())
        for gauge, value in ((family.server_split, stats.server_large_events_split),
                             (family.server_failed, stats.server_large_events_failed),
                             (family.server_examined, stats.server_docs_examined_per_returned)):
            if value is not None:
                gauge.labels(**labels).set(value)
        if stats.last_stored_token_time is not None:
            family.stored_time.labels(**labels).set(stats.last_stored_token_time.timestamp())
