"""Metrics exporters for :func:`changestream.consume`'s ``on_stats`` callback.

Each is optional and imports its library only when used:

* :class:`changestream.exporters.prometheus.PrometheusExporter` (``pip install
  "changestream[prometheus]"``, on ``prometheus_client``);
* :class:`changestream.exporters.otel.OpenTelemetryExporter` (``pip install
  "changestream[opentelemetry]"``, on the OpenTelemetry metrics API).
"""
