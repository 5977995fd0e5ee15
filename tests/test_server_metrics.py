"""The server's change-stream counters beside the client's, and the time to history loss
(issue 32): read rarely, absent with one line where refused, exported by both exporters."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from datetime import timedelta
from typing import Any

import pytest
from bson.timestamp import Timestamp
from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import OperationFailure

import changestream
import changestream.aio
from changestream._metrics import ConsumeStats, StatsReporter
from changestream._position import Position
from changestream._server_metrics import HistoryLossEstimate, ServerMetricsProbe, server_metrics
from changestream._sync._stats_timer import _probe_headroom, _probe_server
from changestream.stores import MemoryTokenStore
from changestream.testing import ReplicaSet

T0 = 1_700_000_000


def status(**change_streams: Any) -> dict[str, Any]:
    return {"ok": 1, "metrics": {"changeStreams": change_streams}}


# -- reading serverStatus ------------------------------------------------------------------------
def test_server_metrics_read_8x_and_9_0_shapes() -> None:
    old = server_metrics(status(largeEventsSplit=2, largeEventsFailed=1))
    assert old is not None
    assert (old.large_events_split, old.large_events_failed) == (2, 1)
    assert old.docs_returned is None and old.docs_examined is None
    new = server_metrics(status(largeEventsSplit=0, largeEventsFailed=0, cursor={
        "totalOpened": 3, "docsReturned": {"sum": 10}, "docsExamined": {"sum": 40}}))
    assert new is not None and (new.docs_returned, new.docs_examined) == (10, 40)
    assert server_metrics({"ok": 1, "metrics": {}}) is None
    assert server_metrics({"ok": 1}) is None


def test_examined_per_returned_is_since_the_previous_read() -> None:
    now = [0.0]
    probe = ServerMetricsProbe(every=60, clock=lambda: now[0])
    assert probe.due()
    probe.read(status(cursor={"docsReturned": {"sum": 10}, "docsExamined": {"sum": 40}}))
    assert probe.examined_per_returned == 4.0  # since the server started
    assert not probe.due()
    now[0] = 61
    assert probe.due()
    probe.read(status(cursor={"docsReturned": {"sum": 20}, "docsExamined": {"sum": 140}}))
    assert probe.examined_per_returned == 10.0  # 100 examined for 10 returned
    probe.read(status(cursor={"docsReturned": {"sum": 20}, "docsExamined": {"sum": 150}}))
    assert probe.examined_per_returned is None  # nothing returned meanwhile


@pytest.mark.parametrize(("error", "why"), [
    (OperationFailure("not authorized on admin to execute command", 13), "clusterMonitor"),
    (OperationFailure("no such command: 'serverStatus'", 59), "serverStatus failed"),
])
def test_a_refused_server_status_is_said_once_and_the_fields_stay_none(
    error: BaseException, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    probe = ServerMetricsProbe()
    with caplog.at_level(logging.INFO, logger="changestream"):
        probe.failed(error)
        probe.failed(error)
    lines = [r for r in caplog.records if "change-stream metrics not reported" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and why in lines[0].getMessage()
    assert not probe.due() and probe.latest is None


def test_a_server_without_the_counters_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    probe = ServerMetricsProbe()
    with caplog.at_level(logging.INFO, logger="changestream"):
        probe.read({"ok": 1, "metrics": {}})
    assert "no metrics.changeStreams" in caplog.text and not probe.due()


class FakeAdmin:
    def __init__(self, reply: Any) -> None:
        self.reply, self.calls = reply, 0

    def command(self, command: Any) -> Any:
        assert command == {"serverStatus": 1}
        self.calls += 1
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply


class FakeStream:
    def __init__(self, admin: FakeAdmin) -> None:
        self.client = type("C", (), {"admin": admin})()
        self.resumes = 0
        self.position = Position(Timestamp(T0, 1), Timestamp(T0, 1))


def test_the_stats_timer_reads_server_status_every_probe_interval_into_the_stats() -> None:
    admin = FakeAdmin(status(largeEventsSplit=5, largeEventsFailed=2, cursor={
        "docsReturned": {"sum": 4}, "docsExamined": {"sum": 12}}))
    reporter = StatsReporter(lambda stats: None, 10.0)
    reporter.on_stream(FakeStream(admin))
    assert reporter.snapshot(0, 0).server_large_events_split is None  # not read yet
    _probe_server(reporter)
    _probe_server(reporter)  # not due again for PROBE_EVERY seconds
    assert admin.calls == 1
    snap = reporter.snapshot(0, 0)
    assert snap.server_large_events_split == 5 and snap.server_large_events_failed == 2
    assert snap.server_docs_examined_per_returned == 3.0


# -- the time to history loss --------------------------------------------------------------------
def test_history_loss_is_the_headroom_over_the_lag_growth_and_warns_once_per_crossing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    estimate = HistoryLossEstimate(warn_below=timedelta(hours=1), reports=6)
    hour = timedelta(hours=1)
    with caplog.at_level(logging.INFO, logger="changestream"):
        # too few reports for a trend
        assert estimate.update(0, timedelta(0), 2 * hour) is None
        assert estimate.update(10, timedelta(seconds=5), 2 * hour) is None
        # lag grows 0.5 s a second: 2 h of headroom last 4 h
        assert estimate.update(20, timedelta(seconds=10), 2 * hour) == 4 * hour
        # the headroom shrinks: 20 min of headroom at 0.5 s/s is 40 min, under the threshold
        assert estimate.update(30, timedelta(seconds=15), timedelta(minutes=20)) == timedelta(
            minutes=40)
        assert estimate.update(40, timedelta(seconds=20), timedelta(minutes=19)) is not None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per crossing
    assert "history loss in about 0:40:00" in warnings[0].getMessage()
    assert "replSetResizeOplog" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="changestream"):
        for t in range(50, 120, 10):  # the consumer caught up: the lag is flat again
            estimate.update(t, timedelta(seconds=20), timedelta(minutes=19))
        assert estimate.update(130, timedelta(seconds=20), timedelta(minutes=19)) is None
    assert "history loss no longer near" in caplog.text


def test_no_estimate_without_headroom_or_with_a_steady_lag() -> None:
    estimate = HistoryLossEstimate()
    for t in range(6):
        assert estimate.update(t * 10.0, timedelta(seconds=t), None) is None  # oplog not full
    steady = HistoryLossEstimate()
    for t in range(6):
        assert steady.update(t * 10.0, timedelta(seconds=2), timedelta(hours=1)) is None


# -- the exporters ---------------------------------------------------------------------------------
def sample(**fields: Any) -> ConsumeStats:
    values: dict[str, Any] = {
        "handled": 1, "events_per_second": 1.0, "lag": timedelta(seconds=1), "position": None,
        "resumes": 0, "reopens": 0, "stored": 0, "last_stored_token_time": None, "elapsed": 1.0,
    }
    values.update(fields)
    return ConsumeStats(**values)


def test_both_exporters_carry_the_server_counters_and_the_time_to_history_loss() -> None:
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason='needs pip install "changestream[prometheus]"')
    pytest.importorskip("opentelemetry.sdk", reason="needs pip install opentelemetry-sdk")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from changestream.exporters.otel import OpenTelemetryExporter
    from changestream.exporters.prometheus import PrometheusExporter

    full = sample(history_lost_in=timedelta(minutes=30), server_large_events_split=7,
                  server_large_events_failed=1, server_docs_examined_per_returned=2.5)
    registry = prometheus_client.CollectorRegistry()
    export = PrometheusExporter(registry, stream="s")
    export(sample())  # nothing known: the gauges stay absent

    def value(name: str) -> float | None:
        result: float | None = registry.get_sample_value(name, {"stream": "s"})
        return result

    assert value("changestream_history_lost_in_seconds") is None
    assert value("changestream_server_large_events_split") is None
    export(full)
    assert value("changestream_history_lost_in_seconds") == 1800
    assert value("changestream_server_large_events_split") == 7
    assert value("changestream_server_large_events_failed") == 1
    assert value("changestream_server_docs_examined_per_returned") == 2.5

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    OpenTelemetryExporter(meter, attributes={"stream": "s"})(full)
    data = reader.get_metrics_data()
    assert data is not None
    points = {metric.name: [p.value for p in metric.data.data_points]
              for resource in data.resource_metrics for scope in resource.scope_metrics
              for metric in scope.metrics}
    assert points["changestream.history_lost_in"] == [1800.0]
    assert points["changestream.server.large_events.split"] == [7]
    assert points["changestream.server.large_events.failed"] == [1]
    assert points["changestream.server.docs_examined_per_returned"] == [2.5]


# -- end to end, on the simulator -------------------------------------------------------------------
@pytest.mark.parametrize("version", ["8.3", "9.0", "9.1"])
def test_consume_reports_the_servers_counters_and_a_full_oplogs_headroom(version: str) -> None:
    """A 64 KiB oplog filled past its limit: the headroom is known ($collStats on
    local.oplog.rs), serverStatus's change-stream counters come with the stats (9.0+: also
    docs examined per returned)."""
    with ReplicaSet(version, oplog_max_bytes=64 * 1024) as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        try:
            coll = client.db.coll
            for i in range(20):
                coll.insert_many([{"i": i, "pad": "x" * 1000} for _ in range(10)])
            reports: list[ConsumeStats] = []
            stop = threading.Event()

            def on_stats(stats: ConsumeStats) -> None:
                reports.append(stats)
                if stats.oplog_headroom is not None and stats.server_large_events_split is not None:
                    stop.set()

            def handle(change: Any) -> None:
                pass

            with changestream.watch(coll, max_await_time_ms=50) as stream:
                start = stream.resume_token
            coll.insert_many([{"i": -1} for _ in range(5)])
            store = MemoryTokenStore()
            store.save(start)
            threading.Timer(20, stop.set).start()  # a bound, not the synchronisation
            changestream.consume(coll, handle, store, watch_options={"max_await_time_ms": 50},
                                 stop=stop, on_stats=on_stats, stats_interval=0.05)
        finally:
            client.close()
    last = reports[-1]
    assert last.oplog_full is True and last.oplog_headroom is not None, last
    assert last.server_large_events_split == 0 and last.server_large_events_failed == 0
    if version == "8.3":
        assert last.server_docs_examined_per_returned is None  # 9.0's cursor sums
    assert last.history_lost_in is None or last.history_lost_in >= timedelta(0)


def test_an_oplog_that_is_not_full_gives_no_headroom_and_no_estimate_end_to_end() -> None:
    with ReplicaSet("9.0") as rs:  # no size limit: $collStats says 990 MiB, far from full
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        try:
            reporter = StatsReporter(lambda stats: None, 10.0)
            stream = changestream.watch(client.db.coll, max_await_time_ms=50)
            try:
                client.db.coll.insert_one({"i": 1})
                stream.try_next()
                reporter.on_stream(stream)
                _probe_headroom(reporter)
                _probe_server(reporter)
                snap = reporter.snapshot(1, 0)
            finally:
                stream.close()
        finally:
            client.close()
    assert snap.oplog_full is False and snap.oplog_headroom is None
    assert snap.history_lost_in is None
    assert snap.server_large_events_split == 0
    assert snap.server_docs_examined_per_returned is not None


def test_through_mongos_the_counters_are_mongos_own_and_the_headroom_is_absent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from changestream.testing import ShardedCluster

    with ShardedCluster("9.0", shards=2, mongoses=1, noop_interval=0.2) as cluster, \
            MongoClient(cluster.uri) as client:
        client.db.coll.insert_one({"i": 0})
        reporter = StatsReporter(lambda stats: None, 10.0)
        with caplog.at_level(logging.INFO, logger="changestream"), \
                changestream.watch(client.db.coll, max_await_time_ms=200) as stream:
            client.db.coll.insert_one({"i": 1})
            assert stream.next()["fullDocument"]["i"] == 1
            reporter.on_stream(stream)
            _probe_headroom(reporter)
            _probe_server(reporter)
            snap = reporter.snapshot(1, 0)
    assert snap.server_large_events_split == 0 and snap.server_large_events_failed == 0
    assert snap.server_docs_examined_per_returned is None  # mongod's cursor sums only
    assert snap.oplog_headroom is None and snap.history_lost_in is None
    assert "not readable through mongos" in caplog.text


# -- the warning without on_stats (issue 32) ---------------------------------------------------------
class OnWarning(logging.Handler):
    """Calls ``then`` when consume logs the time-to-history-loss WARNING."""

    def __init__(self, then: Any) -> None:
        super().__init__(logging.WARNING)
        self.then = then
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("history loss in about"):
            self.messages.append(record.getMessage())
            self.then()


def fill_the_oplog(coll: Any) -> None:
    for i in range(20):  # 200 KB into a 64 KiB oplog: full, truncating
        coll.insert_many([{"i": i, "pad": "x" * 1000} for _ in range(10)])


@pytest.mark.parametrize("version", ["8.3", "9.0", "9.1"])
def test_consume_without_on_stats_warns_before_history_is_lost(version: str) -> None:
    """No on_stats: the handler is stuck on its first change, the lag grows a second per
    second on a full oplog; the WARNING comes while it is stuck (before the position falls
    off), and consume ends without losing history."""
    handled: list[Any] = []
    stop = threading.Event()
    warned = threading.Event()
    catch = OnWarning(warned.set)
    logger = logging.getLogger("changestream.consume")
    with ReplicaSet(version, oplog_max_bytes=64 * 1024) as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        logger.addHandler(catch)
        try:
            coll = client.db.coll
            fill_the_oplog(coll)
            with changestream.watch(coll, max_await_time_ms=50) as stream:
                start = stream.resume_token
            coll.insert_many([{"i": -1} for _ in range(5)])
            store = MemoryTokenStore()
            store.save(start)

            def handle(change: Any) -> None:
                handled.append(change)
                warned.wait(20)  # stuck until warned (20 s: a bound, not the synchronisation)
                stop.set()

            result = changestream.consume(coll, handle, store, stop=stop, stats_interval=0.05,
                                          watch_options={"max_await_time_ms": 50})
        finally:
            logger.removeHandler(catch)
            client.close()
    assert warned.is_set(), "no history-loss warning without on_stats"
    assert len(catch.messages) == 1 and "replSetResizeOplog" in catch.messages[0]
    assert len(handled) == 1 and result.handled == 1  # warned while stuck on the first change


@pytest.mark.parametrize("version", ["8.3", "9.0", "9.1"])
def test_aio_consume_without_on_stats_warns_before_history_is_lost(version: str) -> None:
    """The async twin: the timer is a task of the loop, also without on_stats."""
    handled: list[Any] = []
    messages: list[str] = []

    async def main(uri: str) -> int:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
        stop, warned = asyncio.Event(), asyncio.Event()
        catch = OnWarning(warned.set)  # logged from the timer task, on this loop
        logger = logging.getLogger("changestream.consume")
        logger.addHandler(catch)
        try:
            coll = client.db.coll
            for i in range(20):
                await coll.insert_many([{"i": i, "pad": "x" * 1000} for _ in range(10)])
            async with await changestream.aio.watch(coll, max_await_time_ms=50) as stream:
                start = stream.resume_token
            await coll.insert_many([{"i": -1} for _ in range(5)])
            store = MemoryTokenStore()
            store.save(start)

            async def handle(change: Any) -> None:
                handled.append(change)
                with contextlib.suppress(asyncio.TimeoutError):  # stuck until warned (20 s: a bound)
                    await asyncio.wait_for(warned.wait(), 20)
                stop.set()

            result = await changestream.aio.consume(
                coll, handle, store, stop=stop, stats_interval=0.05,
                watch_options={"max_await_time_ms": 50})
        finally:
            logger.removeHandler(catch)
            messages.extend(catch.messages)
            await client.close()
        return result.handled

    with ReplicaSet(version, oplog_max_bytes=64 * 1024) as rs:
        count = asyncio.run(main(rs.uri))
    assert len(messages) == 1, "no history-loss warning without on_stats"
    assert len(handled) == 1 and count == 1  # warned while stuck on the first change


def test_without_on_stats_the_oplog_is_read_only_while_the_lag_grows() -> None:
    """The cost of the warning without a callback: a consumer that keeps up reads no oplog;
    one falling behind does (every PROBE_EVERY s); with a callback the headroom is reported,
    so always; server_probes=False never."""
    quiet = StatsReporter(None, 10.0)
    assert quiet.wanted and not quiet.reading_oplog
    for t in range(6):  # flat lag
        quiet.history.update(t * 10.0, timedelta(seconds=2), None)
    assert not quiet.reading_oplog
    behind = StatsReporter(None, 10.0)
    for t in range(3):  # a second more lag every 10 s
        behind.history.update(t * 10.0, timedelta(seconds=t), None)
    assert behind.reading_oplog
    assert StatsReporter(lambda stats: None, 10.0).reading_oplog
    off = StatsReporter(lambda stats: None, 10.0, probes=False)
    assert not off.reading_oplog and off.wanted  # the reports still come
    assert not StatsReporter(None, 10.0, probes=False).wanted  # no timer at all
