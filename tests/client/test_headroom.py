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


class FakeClient:
    def __init__(self, kind: str, oplog: FakeOplog) -> None:
        self.topology_description = type("T", (), {"topology_type_name": kind})()
        self.local = {"oplog.rs": oplog}


class FakeStream:
    def __init__(self, client: FakeClient, token_time: int) -> None:
        self.client = client
        self.resumes = 0
        self.position = Position(Timestamp(token_time, 1), Timestamp(token_time, 1))


def reporter_on(kind: str, oplog: FakeOplog, token_time: int) -> StatsReporter:
    reporter = StatsReporter(lambda stats: None, 10.0)
    reporter.on_stream(FakeStream(FakeClient(kind, oplog), token_time))
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
         "grant the user 'find' on the 'local' database"),
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
