"""The Spark source's read-ahead under a server that fails every getMore: backoff, then one error."""

from __future__ import annotations

import time
from typing import Any

import pytest
from pymongo import MongoClient, monitoring
from pymongo.errors import AutoReconnect, OperationFailure
from spark_support import current_token

import changestream
from changestream._consumer.retry import RetryPolicy
from changestream.spark_adapter import _prefetch, _readahead
from changestream.spark_adapter._config import SourceConfig
from changestream.spark_adapter._offsets import make_offset

pytestmark = pytest.mark.spark


class AggregateCounter(monitoring.CommandListener):
    def __init__(self) -> None:
        self.aggregates = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.aggregates += event.command_name == "aggregate"

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_read_ahead_backs_off_then_names_the_repeated_failure(
    mongodb_uri: str, coll: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = AggregateCounter()
    monkeypatch.setattr(_prefetch, "RETRY", RetryPolicy(2.0, 0.2, 1.0))
    monkeypatch.setattr(SourceConfig, "connect",
                        lambda self: MongoClient(self.uri, event_listeners=[counter]))
    config = SourceConfig.from_options(
        {"uri": mongodb_uri, "database": coll.database.name, "collection": coll.name}
    )
    start = make_offset(current_token(coll))
    reader = _readahead.ReadAhead(config)
    with MongoClient(mongodb_uri) as admin:
        admin.admin.command("configureFailPoint", "failCommand", mode="alwaysOn",
                            data={"failCommands": ["getMore"], "errorCode": 43})
        started = time.monotonic()
        try:
            with pytest.raises(changestream.RetriesExhaustedError) as info:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    reader.take(start, 10, None, time.monotonic() + 1)
        finally:
            admin.admin.command("configureFailPoint", "failCommand", mode="off")
            reader.shutdown()
    elapsed = time.monotonic() - started
    assert 2.0 <= elapsed < 30
    assert counter.aggregates / elapsed < 8, counter.aggregates
    assert "43 CursorNotFound" in str(info.value)
    assert "full error" not in str(info.value)


def test_opening_the_stream_backs_off_over_transient_failures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both Spark paths open their stream through ``open_retrying`` (a mongos gone, a failover)."""
    monkeypatch.setattr(_prefetch, "RETRY", RetryPolicy(5.0, 0.05, 0.2))
    calls: list[float] = []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise AutoReconnect("connection closed")
        return "stream"

    assert _prefetch.open_retrying(flaky) == "stream"
    assert len(calls) == 3 and calls[2] - calls[1] >= 0.05, "backed off between tries"

    def broken() -> str:
        calls.append(time.monotonic())
        raise OperationFailure("bad pipeline", code=40324)

    calls.clear()
    with pytest.raises(OperationFailure):
        _prefetch.open_retrying(broken)
    assert len(calls) == 1, "a non-transient error is not retried"
