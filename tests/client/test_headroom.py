"""Oplog headroom: read where the deployment allows it, absent with one log line where not."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from bson.timestamp import Timestamp
from pymongo.errors import OperationFailure

from changestream._headroom import HeadroomProbe
from changestream._metrics import StatsReporter
from changestream._position import Position
from changestream._sync._stats_timer import _probe_headroom

T0 = 1_700_000_000


class FakeOplog:
    def __init__(self, entry: Any = None, error: BaseException | None = None) -> None:
        self.entry, self.error, self.reads = entry, error, 0

    def find_one(self, query: Any, **kwargs: Any) -> Any:
        self.reads += 1
        assert kwargs["sort"] == [("$natural", 1)]
        if self.error is not None:
            raise self.error
        return self.entry


def storage(size: int, max_size: int | None = 100 << 20) -> dict[str, Any]:
    """A reply to the ``$collStats`` aggregate on ``local.oplog.rs``."""
    stats: dict[str, Any] = {"size": size, "capped": max_size is not None}
    if max_size is not None:
        stats["maxSize"] = max_size
    return {"cursor": {"firstBatch": [{"storageStats": stats}], "id": 0}, "ok": 1}


FULL = storage(99 << 20)


class FakeLocal(dict):  # type: ignore[type-arg]
    """``client.local``: the oplog collection, and the storage stats command."""

    def __init__(self, oplog: FakeOplog, stats: Any) -> None:
        super().__init__({"oplog.rs": oplog})
        self.stats = stats

    def command(self, command: Any) -> Any:
        assert command["pipeline"] == [{"$collStats": {"storageStats": {}}}]
        if isinstance(self.stats, BaseException):
            raise self.stats
        return self.stats


class FakeClient:
    def __init__(self, kind: str, oplog: FakeOplog, stats: Any = FULL) -> None:
        self.topology_description = type("T", (), {"topology_type_name": kind})()
        self.local = FakeLocal(oplog, stats)


class FakeStream:
    def __init__(self, client: FakeClient, token_time: int) -> None:
        self.client = client
        self.resumes = 0
        self.position = Position(Timestamp(token_time, 1), Timestamp(token_time, 1))


def reporter_on(kind: str, oplog: FakeOplog, token_time: int, stats: Any = FULL) -> StatsReporter:
    reporter = StatsReporter(lambda stats: None, 10.0)
    reporter.on_stream(FakeStream(FakeClient(kind, oplog, stats), token_time))
    return reporter


def test_a_replica_set_reports_token_time_minus_the_oldest_entry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    oplog = FakeOplog({"ts": Timestamp(T0 - 7200, 3)})
    reporter = reporter_on("ReplicaSetWithPrimary", oplog, T0)
    _probe_headroom(reporter)
    _probe_headroom(reporter)  # not due again for a minute
    assert oplog.reads == 1
    assert reporter.snapshot(0, 0).oplog_headroom == timedelta(hours=2)
    with caplog.at_level(logging.WARNING, logger="changestream"):
        close = reporter_on("ReplicaSetWithPrimary", FakeOplog({"ts": Timestamp(T0 - 60, 1)}), T0)
        _probe_headroom(close)
        for _ in range(3):
            assert close.snapshot(0, 0).oplog_headroom == timedelta(minutes=1)
    [warning] = [r for r in caplog.records if "oplog headroom is 0:01:00" in r.getMessage()]
    assert "replSetResizeOplog" in warning.getMessage()


@pytest.mark.parametrize(
    ("kind", "oplog", "why"),
    [
        ("Sharded", FakeOplog(), "sharded cluster: the oplog of the shards is not readable"),
        ("LoadBalanced", FakeOplog(), "behind a load balancer"),
        ("ReplicaSetWithPrimary",
         FakeOplog(error=OperationFailure("not authorized on local", 13)),
         "grant the user 'find' and 'collStats' on the 'local' database"),
        ("ReplicaSetWithPrimary", FakeOplog(None), "returned no entry"),
    ],
)
def test_where_it_cannot_be_read_it_is_absent_and_one_line_says_why(
    kind: str, oplog: FakeOplog, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    reporter = reporter_on(kind, oplog, T0)
    with caplog.at_level(logging.INFO, logger="changestream"):
        for _ in range(3):
            _probe_headroom(reporter)
            assert reporter.snapshot(0, 0).oplog_headroom is None
    lines = [r.getMessage() for r in caplog.records if "headroom" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0], lines
    assert oplog.reads <= 1


def test_a_transient_failure_is_tried_again_later() -> None:
    now = [0.0]
    probe = HeadroomProbe(clock=lambda: now[0])
    assert probe.due()
    probe.failed(OperationFailure("primary stepped down", 189))
    assert probe.unavailable is None and not probe.due()
    now[0] = 61.0
    assert probe.due()


@pytest.mark.parametrize(
    ("stats", "why"),
    [
        (storage(3 << 20), "the oplog is not full (3%: 3.0 of 100.0 MiB)"),
        (storage(3 << 20, max_size=None), "the oplog has no size limit"),
    ],
)
def test_an_oplog_that_is_not_full_has_no_headroom_and_no_warning(
    stats: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 33, item 13: a new deployment's oldest entry is seconds old, and every run
    warned "oplog headroom is 0:00:00 ... the history is lost" while nothing is truncated."""
    oplog = FakeOplog({"ts": Timestamp(T0 - 5, 1)})
    reporter = reporter_on("ReplicaSetWithPrimary", oplog, T0, stats)
    with caplog.at_level(logging.INFO, logger="changestream"):
        _probe_headroom(reporter)
        snapshot = reporter.snapshot(0, 0)
    assert snapshot.oplog_headroom is None and snapshot.oplog_full is False
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    [line] = [r.getMessage() for r in caplog.records if "headroom" in r.getMessage()]
    assert why in line and "0:00:00" not in line
    # Once full, the headroom is the token's distance from the oldest entry.
    reporter.headroom.read_fill(FULL)
    assert reporter.snapshot(0, 0).oplog_headroom == timedelta(seconds=5)


def test_when_how_full_cannot_be_told_the_headroom_is_unknown_not_0(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The simulator answers no $collStats on local.oplog.rs (115), servers without the
    privilege 13: "cannot tell" is unknown, never 0, said once, and not read again."""
    oplog = FakeOplog({"ts": Timestamp(T0 - 5, 1)})
    unsupported = OperationFailure("no $collStats here", 115)
    reporter = reporter_on("ReplicaSetWithPrimary", oplog, T0, unsupported)
    with caplog.at_level(logging.INFO, logger="changestream"):
        for _ in range(3):
            _probe_headroom(reporter)
            snapshot = reporter.snapshot(0, 0)
            assert snapshot.oplog_headroom is None and snapshot.oplog_full is None
    lines = [r.getMessage() for r in caplog.records if "headroom" in r.getMessage()]
    assert len(lines) == 1 and "how full the oplog is cannot be told" in lines[0], lines
    assert "collStats" in lines[0] and oplog.reads == 0


def test_consume_on_a_new_deployment_does_not_cry_wolf(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """End to end on the simulator (whose unbounded oplog answers $collStats with mongod's
    990 MiB default maxSize): not full, so no headroom and no warning, never 0."""
    import threading

    from pymongo import MongoClient

    import changestream
    from changestream.stores import MemoryTokenStore
    from changestream.testing import ReplicaSet

    with ReplicaSet("8.0") as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        coll = client.db.coll
        coll.insert_one({"i": 0})
        stop = threading.Event()
        reports: list[Any] = []

        def report(stats: Any) -> None:
            reports.append(stats)
            if len(reports) > 3:
                stop.set()

        coll.insert_many([{"i": i} for i in range(5)])
        with caplog.at_level(logging.INFO, logger="changestream"):
            changestream.consume(coll, lambda change: None, MemoryTokenStore(), stop=stop,
                                 on_stats=report, stats_interval=0.05,
                                 watch_options={"max_await_time_ms": 50})
        client.close()
    assert not [r for r in caplog.records if "oplog headroom is" in r.getMessage()]
    assert all(stats.oplog_headroom is None for stats in reports)
    assert all(stats.oplog_full is False for stats in reports if stats.oplog_full is not None)
    assert any(stats.oplog_full is False for stats in reports)
    assert "the oplog is not full" in caplog.text


def test_a_full_simulated_oplog_gives_the_headroom_end_to_end() -> None:
    """The simulator's $collStats on local.oplog.rs (issue 32): an oplog of 64 KiB filled
    past its limit is full, and the headroom is token time minus its oldest entry."""
    from pymongo import MongoClient

    import changestream
    from changestream._sync._stats_timer import _probe_headroom
    from changestream.testing import ReplicaSet

    with ReplicaSet("9.0", oplog_max_bytes=64 * 1024) as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        try:
            coll = client.db.coll
            for i in range(20):
                coll.insert_many([{"i": i, "pad": "x" * 1000} for _ in range(10)])
            oldest = client.local["oplog.rs"].find_one({}, sort=[("$natural", 1)])
            assert oldest is not None
            reporter = StatsReporter(lambda stats: None, 10.0)
            with changestream.watch(coll, max_await_time_ms=50) as stream:
                coll.insert_one({"i": -1})
                assert stream.try_next() is not None
                reporter.on_stream(stream)
                _probe_headroom(reporter)
                snap = reporter.snapshot(1, 0)
                token_time = stream.position.token_time
        finally:
            client.close()
    assert snap.oplog_full is True
    assert token_time is not None
    assert snap.oplog_headroom == timedelta(seconds=token_time.time - oldest["ts"].time)
