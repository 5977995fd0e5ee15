"""The stream's position and lag, worked out by the sans-IO machine from the server's replies."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from bson.timestamp import Timestamp
from test_machine import Driver, aggregate_reply, delivered, getmore_reply, resumable

from changestream._position import Position, newest_reply_time

T0 = 1_700_000_000


def tok(seconds: int, inc: int = 1) -> dict[str, Any]:
    """A resume token at cluster time ``Timestamp(seconds, inc)`` (KeyString 0x82 prefix)."""
    return {"_data": f"82{seconds:08X}{inc:08X}2B0229296E04"}


def ev(seconds: int, inc: int = 1) -> dict[str, Any]:
    return {"_id": tok(seconds, inc), "operationType": "insert", "documentKey": {"_id": inc}}


def with_times(reply: dict[str, Any], operation: int | None, cluster: int | None) -> dict[str, Any]:
    if operation is not None:
        reply["operationTime"] = Timestamp(operation, 1)
    if cluster is not None:
        reply["$clusterTime"] = {"clusterTime": Timestamp(cluster, 3), "signature": {}}
    return reply


def test_position_lag_is_server_time_minus_token_time() -> None:
    position = Position(Timestamp(T0, 5), Timestamp(T0 + 42, 1))
    assert position.lag == timedelta(seconds=42)
    assert position.token_datetime == datetime.fromtimestamp(T0, tz=timezone.utc)
    assert position.server_datetime == datetime.fromtimestamp(T0 + 42, tz=timezone.utc)
    assert Position(None, Timestamp(T0, 1)).lag is None
    assert Position.of(None, None) == Position(None, None)
    # A token ahead of the server (another deployment's, or corrupted) shows as such.
    ahead = Position.of(tok(T0 + 9), Timestamp(T0, 1))
    assert ahead.lag == timedelta(seconds=-9) and ahead.ahead == timedelta(seconds=9)
    assert Position.of(tok(T0), Timestamp(T0, 1)).ahead is None
    assert Position.of({"_data": "not hex"}, Timestamp(T0, 1)).token_time is None


def test_newest_reply_time_takes_the_latest_of_operation_time_cluster_time_and_pbrt() -> None:
    # A server echoes a token it has not reached as its postBatchResumeToken: the
    # cluster time is its clock; the token counts only in a reply without one.
    reply = with_times(getmore_reply([], tok(T0 + 7)), T0 + 3, T0 + 5)
    assert newest_reply_time(reply, None) == Timestamp(T0 + 5, 3)
    assert newest_reply_time(reply, Timestamp(T0 + 8, 0)) == Timestamp(T0 + 8, 0)
    assert newest_reply_time(getmore_reply([], tok(T0 + 7)), None) == Timestamp(T0 + 7, 1)
    assert newest_reply_time({"operationTime": "junk", "$clusterTime": 3}, None) is None


class Clock:
    """A local monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_machine_lag_grows_while_behind_and_vanishes_once_caught_up() -> None:
    driver = Driver()
    clock = driver.machine.clock = Clock()
    driver.start(with_times(aggregate_reply([], tok(T0)), T0, T0))
    assert driver.machine.position.lag == timedelta(0)
    # One getMore brings three events written 0, 10 and 20 s after T0; the server is at T0 + 30.
    batch = [ev(T0), ev(T0 + 10), ev(T0 + 20)]
    delivered(driver.next(with_times(getmore_reply(batch, tok(T0 + 20, 2)), T0 + 30, T0 + 30)))
    assert driver.machine.position.lag == timedelta(seconds=30)
    # The batch is being handled: the local time since its reply counts (no reply comes).
    clock.now += 12
    assert driver.machine.position.lag == timedelta(seconds=42)
    delivered(driver.next())
    assert driver.machine.position.lag == timedelta(seconds=32)
    delivered(driver.next())
    # Last of the batch, still being handled: its own time counts (the token already is
    # the postBatchResumeToken).
    assert driver.machine.resume_token == tok(T0 + 20, 2)
    assert driver.machine.position.token_time == Timestamp(T0 + 20, 1)
    assert driver.machine.position.lag == timedelta(seconds=22)
    # An empty batch moves the token to where the server is: caught up, 0 ...
    driver.try_next(with_times(getmore_reply([], tok(T0 + 31)), T0 + 31, T0 + 31))
    assert driver.machine.position.lag == timedelta(0)
    assert driver.machine.position.server_time == Timestamp(T0 + 31, 3)
    clock.now += 0.9  # ... while the next getMore is within its await (1 s) ...
    assert driver.machine.position.lag == timedelta(0)
    clock.now += 5.1  # ... and growing once no reply comes (an outage): 6 s - 1 s.
    assert driver.machine.position.lag == timedelta(seconds=5)


def test_an_empty_batch_whose_token_trails_the_server_shows_the_lag() -> None:
    """A busy server (a long scan of entries that do not match) or an idle shard answers
    an empty batch whose postBatchResumeToken trails its cluster time: that is how far
    behind the stream is, not 0 (issue 33, item 2: 0.0 s reported while 11 s behind)."""
    driver = Driver()
    clock = driver.machine.clock = Clock()
    driver.start(with_times(aggregate_reply([], tok(T0)), T0, T0))
    driver.try_next(with_times(getmore_reply([], tok(T0 + 3)), T0 + 14, T0 + 14))
    position = driver.machine.position
    assert position.caught_up and position.lag == timedelta(seconds=11)
    clock.now += 0.5  # the next getMore is in flight, within its await: still 11 s
    assert driver.machine.position.lag == timedelta(seconds=11)
    clock.now += 2.5  # overdue by 2 s
    assert driver.machine.position.lag == timedelta(seconds=13)
    # The scan reaches the present: 0.
    driver.try_next(with_times(getmore_reply([], tok(T0 + 17)), T0 + 17, T0 + 17))
    assert driver.machine.position.lag == timedelta(0)


def test_a_drained_batch_counts_only_an_overdue_reply() -> None:
    driver = Driver()
    clock = driver.machine.clock = Clock()
    driver.start(with_times(aggregate_reply([], tok(T0)), T0, T0))
    batch = [ev(T0 + 29), ev(T0 + 30)]
    delivered(driver.next(with_times(getmore_reply(batch, tok(T0 + 30, 2)), T0 + 30, T0 + 30)))
    delivered(driver.next())
    clock.now += 3  # handled in 3 s
    assert driver.machine.position.lag == timedelta(seconds=3)
    driver.machine.begin_try_next()  # back for more: the getMore is in flight
    assert driver.machine.position.lag == timedelta(0)
    clock.now += 4
    assert driver.machine.position.lag == timedelta(seconds=3)


def test_resumes_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    driver = Driver()
    driver.start(aggregate_reply([], tok(T0)))
    assert driver.machine.resumes == 0
    with caplog.at_level(logging.INFO, logger="changestream"):
        result = driver.try_next(
            resumable(), {"ok": 1}, aggregate_reply([ev(T0 + 1)], tok(T0 + 1))
        )
    assert delivered(result)["_id"] == tok(T0 + 1)
    assert driver.machine.resumes == 1
    [record] = [r for r in caplog.records if r.name == "changestream.stream"]
    assert record.levelno == logging.INFO
    assert "resuming the change stream on db.coll (resume 1" in record.getMessage()
    assert f"cluster time Timestamp({T0}, 1)" in record.getMessage()


def test_the_resume_log_line_leaves_out_pymongos_reply_dump(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 33, item 17: the INFO line of a resume carried PyMongo's "full error: {...}"
    (with $clusterTime and its signature), which docs/consume.md says is left out."""
    from pymongo.errors import OperationFailure

    from changestream._machine import ErrorInfo

    driver = Driver()
    driver.start(aggregate_reply([], tok(T0)))
    failure = OperationFailure(
        "primary stepped down", 189,
        {"ok": 0, "errmsg": "primary stepped down", "code": 189, "codeName": "PrimarySteppedDown",
         "errorLabels": ["ResumableChangeStreamError"],
         "$clusterTime": {"clusterTime": Timestamp(T0, 1), "signature": {"hash": b"x" * 20}}},
    )
    with caplog.at_level(logging.INFO, logger="changestream"):
        error = ErrorInfo(exception=failure, code=189,
                          labels=frozenset({"ResumableChangeStreamError"}), wire_version=21,
                          is_network=False, is_timeout=False, is_server_selection=False)
        driver.try_next(error, {"ok": 1}, aggregate_reply([ev(T0 + 1)], tok(T0 + 1)))
    [line] = [r.getMessage() for r in caplog.records if r.name == "changestream.stream"]
    assert "189 PrimarySteppedDown: primary stepped down" in line
    assert "full error" not in line and "signature" not in line
