"""``consume(on_stats=...)``: progress reports, their logging, and the Prometheus / OpenTelemetry exporters."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from bson.timestamp import Timestamp
from pymongo import MongoClient
from pymongo.errors import PyMongoError

import changestream
from changestream._metrics import ConsumeStats, StatsReporter
from changestream._position import Position
from changestream.stores import MemoryTokenStore

T0 = 1_700_000_000


def stats(handled: int, **fields: Any) -> ConsumeStats:
    values: dict[str, Any] = {
        "handled": handled, "events_per_second": 2.5, "lag": timedelta(seconds=4),
        "position": Position(Timestamp(T0, 1), Timestamp(T0 + 4, 1)), "resumes": 1,
        "reopens": 0, "stored": 3,
        "last_stored_token_time": datetime.fromtimestamp(T0, tz=timezone.utc), "elapsed": 1.0,
    }
    values.update(fields)
    return ConsumeStats(**values)


class FakeStream:
    def __init__(self, resumes: int) -> None:
        self.resumes = resumes
        self.position = Position(Timestamp(T0, 1), Timestamp(T0 + 7, 1))


def test_reporter_schedule_rate_and_resumes_across_streams(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    seen: list[ConsumeStats] = []
    reporter = StatsReporter(seen.append, 5.0, clock=lambda: now[0])
    reporter.on_stream(FakeStream(resumes=2))
    now[0] = 104.0
    reporter.poll(handled=40, reopens=0)
    assert seen == []  # not due yet
    now[0] = 105.0
    reporter.poll(handled=50, reopens=0)
    assert [(s.handled, s.events_per_second, s.lag) for s in seen] == [
        (50, 10.0, timedelta(seconds=7))
    ]
    reporter.on_stream(FakeStream(resumes=1))  # a reopened stream: resumes add up
    with caplog.at_level(logging.DEBUG, logger="changestream"):
        reporter.on_stored({"_data": f"82{T0 + 3:08X}00000001"})
    assert "stored the resume token (cluster time Timestamp(1700000003, 1))" in caplog.text
    now[0] = 107.0
    reporter.finish(handled=60, reopens=1)
    last = seen[-1]
    assert last.final and last.resumes == 3 and last.reopens == 1 and last.stored == 1
    assert last.events_per_second == 5.0 and last.elapsed == 7.0
    assert last.last_stored_token_time == datetime.fromtimestamp(T0 + 3, tz=timezone.utc)


def test_reporter_checks_its_interval_and_survives_a_failing_callback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for bad in (0, -1, "5", True):
        with pytest.raises(ValueError, match="stats_interval must be a number of seconds > 0"):
            StatsReporter(print, bad)  # type: ignore[arg-type]

    def broken(_: ConsumeStats) -> None:
        raise RuntimeError("exporter down")

    reporter = StatsReporter(broken, 1.0)
    reporter.finish(handled=1, reopens=0)
    assert "the on_stats callback failed (ignored)" in caplog.text


def test_consume_reports_handled_rate_lag_resumes_and_the_stored_token(
    simulator: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    coll = client.db.coll
    coll.insert_one({"setup": 1})
    reports: list[ConsumeStats] = []
    handled: list[Any] = []
    stop = threading.Event()
    opened = threading.Event()

    def open_stream(token: Any) -> changestream.ChangeStream[Any]:
        stream = changestream.watch(coll, resume_after=token, max_await_time_ms=50)
        opened.set()
        return stream

    def handle(change: Any) -> None:
        handled.append(change)
        if len(handled) == 6:
            stop.set()

    result: list[Any] = []
    thread = threading.Thread(
        target=lambda: result.append(changestream.consume(
            open_stream, handle, MemoryTokenStore(), stop=stop,
            on_stats=reports.append, stats_interval=0.05,
        )),
        daemon=True,
    )
    caplog.set_level(logging.DEBUG, logger="changestream")
    # The first getMore loses its connection: the stream resumes by itself.
    client.admin.command("configureFailPoint", "failCommand", mode={"times": 1},
                         data={"failCommands": ["getMore"], "closeConnection": True})
    try:
        thread.start()
        assert opened.wait(30)
        coll.insert_many([{"i": i} for i in range(3)])
        deadline = time.monotonic() + 30
        while len(reports) < 2 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        coll.insert_many([{"i": i} for i in range(3, 6)])
        thread.join(60)
        assert not thread.is_alive() and result, "consume() did not stop"
    finally:
        stop.set()
        with contextlib.suppress(PyMongoError):
            client.admin.command("configureFailPoint", "failCommand", mode="off")
        client.close()
    final = reports[-1]
    assert final.final and [r for r in reports if r.final] == [final]
    assert final.handled == 6 and final.resumes == 1 and final.reopens == 0
    assert final.stored >= 1 and final.last_stored_token_time is not None
    assert final.lag is not None and final.lag <= timedelta(seconds=5)
    assert len(reports) >= 2 and all(r.events_per_second >= 0 for r in reports)
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    assert any(n == "changestream.stream" and "resuming the change stream on db.coll" in m
               for n, m in messages)
    assert any(n == "changestream.consume" and m.startswith("stored the resume token")
               for n, m in messages)


def test_prometheus_exporter_counts_deltas_and_sets_gauges() -> None:
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason='needs pip install "changestream[prometheus]"'
    )
    from changestream.exporters.prometheus import PrometheusExporter

    registry = prometheus_client.CollectorRegistry()
    export = PrometheusExporter(registry, stream="orders")
    export(stats(10))
    export(stats(25, resumes=2, stored=5, lag=timedelta(seconds=1)))

    def value(name: str) -> float | None:
        result: float | None = registry.get_sample_value(name, {"stream": "orders"})
        return result

    assert value("changestream_events_handled_total") == 25
    assert value("changestream_resumes_total") == 2
    assert value("changestream_tokens_stored_total") == 5
    assert value("changestream_reopens_total") == 0
    assert value("changestream_lag_seconds") == 1
    assert value("changestream_events_per_second") == 2.5
    assert value("changestream_last_stored_token_timestamp") == T0


def test_opentelemetry_exporter_records_counters_and_gauges() -> None:
    pytest.importorskip("opentelemetry.sdk", reason='needs pip install opentelemetry-sdk')
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from changestream.exporters.otel import OpenTelemetryExporter

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    export = OpenTelemetryExporter(meter, attributes={"stream": "orders"})
    export(stats(10))
    export(stats(25, resumes=2, lag=timedelta(seconds=1)))
    data = reader.get_metrics_data()
    assert data is not None
    points = {
        metric.name: [(p.value, dict(p.attributes or {})) for p in metric.data.data_points]
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert points["changestream.events.handled"] == [(25, {"stream": "orders"})]
    assert points["changestream.resumes"] == [(2, {"stream": "orders"})]
    assert points["changestream.lag"] == [(1.0, {"stream": "orders"})]
    assert points["changestream.events.rate"] == [(2.5, {"stream": "orders"})]
    assert points["changestream.last_stored_token.timestamp"] == [(T0, {"stream": "orders"})]


def test_two_prometheus_exporters_share_one_family_with_a_label_each() -> None:
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason='needs pip install "changestream[prometheus]"'
    )
    from changestream.exporters.prometheus import PrometheusExporter

    registry = prometheus_client.CollectorRegistry()
    orders = PrometheusExporter(registry, stream="orders")
    users = PrometheusExporter(registry, stream="users")  # raised DuplicateTimeseries before
    orders(stats(10, lag=timedelta(seconds=3), oplog_headroom=timedelta(hours=2)))
    users(stats(4, lag=timedelta(seconds=9)))
    assert registry.get_sample_value("changestream_events_handled_total", {"stream": "orders"}) == 10
    assert registry.get_sample_value("changestream_events_handled_total", {"stream": "users"}) == 4
    assert registry.get_sample_value("changestream_lag_seconds", {"stream": "users"}) == 9
    assert registry.get_sample_value(
        "changestream_oplog_headroom_seconds", {"stream": "orders"}) == 7200
    # Absent, not 0, where the headroom cannot be read.
    assert registry.get_sample_value(
        "changestream_oplog_headroom_seconds", {"stream": "users"}) is None
    with pytest.raises(ValueError, match=r"labels \['stream'\], not \['db', 'stream'\]"):
        PrometheusExporter(registry, stream="x", db="y")


def test_the_prometheus_endpoint_listens_on_loopback_unless_told_otherwise() -> None:
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason='needs pip install "changestream[prometheus]"'
    )
    from changestream.exporters.prometheus import serve

    started = serve(0, registry=prometheus_client.CollectorRegistry())
    if not isinstance(started, tuple):
        pytest.skip("this prometheus_client's start_http_server returns no server to inspect")
    server, thread = started
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_two_opentelemetry_exporters_on_one_meter_both_report() -> None:
    pytest.importorskip("opentelemetry.sdk", reason='needs pip install opentelemetry-sdk')
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from changestream.exporters.otel import OpenTelemetryExporter

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    orders = OpenTelemetryExporter(meter, attributes={"stream": "orders"})
    users = OpenTelemetryExporter(meter, attributes={"stream": "users"})
    orders(stats(10, lag=timedelta(seconds=3)))
    users(stats(4, lag=timedelta(seconds=9), oplog_headroom=timedelta(minutes=5)))
    data = reader.get_metrics_data()
    assert data is not None
    points = {
        metric.name: sorted((dict(p.attributes or {})["stream"], p.value)
                            for p in metric.data.data_points)
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert points["changestream.events.handled"] == [("orders", 10), ("users", 4)]
    assert points["changestream.lag"] == [("orders", 3.0), ("users", 9.0)]
    assert points["changestream.oplog.headroom"] == [("users", 300.0)]


def run_consume(coll: Any, on_stats: Any, changes: int, *, on_error: Any = None,
                store: Any = None) -> None:
    """One ``consume`` call over ``changes`` new inserts, stopped once it handled them."""
    stop = threading.Event()
    seen: set[int] = set()

    def handle(change: Any) -> None:
        seen.add(change["fullDocument"]["i"])  # a retried change counts once
        if len(seen) == changes:
            stop.set()
        if change["fullDocument"].get("poison"):
            raise ValueError("poison")

    start = coll.find_one(sort=[("i", -1)])
    first = 0 if start is None or "i" not in start else start["i"] + 1
    coll.insert_many([{"i": first + n, "poison": n == 7} for n in range(changes)])
    changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token, start_at_operation_time=(
            None if token is not None else Timestamp(0, 1)), max_await_time_ms=50),
        handle, store, stop=stop, on_stats=on_stats, on_error=on_error,
    )


def test_an_exporter_reused_by_later_consume_calls_counts_every_call(simulator: Any) -> None:
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason='needs pip install "changestream[prometheus]"'
    )
    pytest.importorskip("opentelemetry.sdk", reason="needs pip install opentelemetry-sdk")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from changestream.exporters.otel import OpenTelemetryExporter
    from changestream.exporters.prometheus import PrometheusExporter

    registry = prometheus_client.CollectorRegistry()
    prometheus = PrometheusExporter(registry, stream="orders")
    reader = InMemoryMetricReader()
    otel = OpenTelemetryExporter(MeterProvider(metric_readers=[reader]).get_meter("t"),
                                 attributes={"stream": "orders"})
    finals: list[ConsumeStats] = []

    def export(stats: ConsumeStats) -> None:
        prometheus(stats)
        otel(stats)
        if stats.final:
            finals.append(stats)

    client: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    coll = client.db.coll
    store = MemoryTokenStore()
    dead: list[Any] = []
    policy = changestream.OnError(retries=1, backoff_initial=0,
                                  dead_letter=lambda change, exc: dead.append(change))
    run_consume(coll, export, 50, on_error=policy, store=store)
    run_consume(coll, export, 30, on_error=policy, store=store)  # a restart: counts from 0
    client.close()
    assert [(s.handled, s.retries, s.dead_letters) for s in finals] == [(50, 1, 1), (30, 1, 1)]

    def prom(name: str) -> float | None:
        value: float | None = registry.get_sample_value(name, {"stream": "orders"})
        return value

    assert prom("changestream_events_handled_total") == 80
    assert prom("changestream_handler_retries_total") == 2
    assert prom("changestream_dead_letters_total") == 2
    data = reader.get_metrics_data()
    assert data is not None
    otel_points = {
        metric.name: [p.value for p in metric.data.data_points]
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert otel_points["changestream.events.handled"] == [80]
    assert otel_points["changestream.handler.retries"] == [2]
    assert otel_points["changestream.dead_letters"] == [2]
    assert finals[0].run_id != finals[1].run_id


def test_a_dead_letter_that_raises_is_not_counted(simulator: Any) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    finals: list[ConsumeStats] = []

    def broken(change: Any, exc: BaseException) -> None:
        raise RuntimeError("the dead-letter queue is down")

    with pytest.raises(RuntimeError, match="the dead-letter queue is down"):
        run_consume(client.db.coll, lambda s: finals.append(s) if s.final else None, 10,
                    on_error=changestream.OnError(retries=0, dead_letter=broken),
                    store=MemoryTokenStore())
    client.close()
    assert [s.dead_letters for s in finals] == [0]


def test_async_consume_counts_a_dead_letter_only_once_it_returned(simulator: Any) -> None:
    import asyncio

    from pymongo import AsyncMongoClient

    import changestream.aio

    finals: list[ConsumeStats] = []

    async def main() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(simulator.uri)
        coll = client.db.coll
        await coll.insert_many([{"i": i} for i in range(5)])
        taken: list[Any] = []

        async def dead_letter(change: Any, exc: BaseException) -> None:
            if change["fullDocument"]["i"] == 3:
                raise RuntimeError("the dead-letter queue is down")
            taken.append(change)

        async def handle(change: Any) -> None:
            raise ValueError("poison")

        with pytest.raises(RuntimeError, match="the dead-letter queue is down"):
            await changestream.aio.consume(
                lambda token: changestream.aio.watch(
                    coll, resume_after=token, start_at_operation_time=Timestamp(0, 1),
                    max_await_time_ms=50),
                handle, MemoryTokenStore(),
                on_stats=lambda s: finals.append(s) if s.final else None,
                on_error=changestream.OnError(retries=0, dead_letter=dead_letter),
            )
        assert len(taken) == 3
        await client.close()

    asyncio.run(main())
    assert [s.dead_letters for s in finals] == [3]
