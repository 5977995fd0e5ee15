"""The spec suite's target pool keeps only a few simulators running (``MAX_LIVE_SIMULATORS``)."""

from __future__ import annotations

import os

import pytest
from pymongo import MongoClient
from pymongo.errors import PyMongoError

from spec_tests.runner import RunnerError
from spec_tests.runner.targets import TargetPool

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("MONGODB_URI")),
    reason="the pool starts simulators only when MONGODB_URI is not set",
)


def _answers(uri: str, version: str) -> bool:
    """Whether a server of ``version`` answers at ``uri`` (a new simulator may take its port)."""
    client: MongoClient[dict[str, object]] = MongoClient(
        uri, serverSelectionTimeoutMS=500, connectTimeoutMS=500, directConnection=False)
    try:
        return str(client.admin.command("buildInfo")["version"]).startswith(version)
    except PyMongoError:
        return False
    finally:
        client.close()


def test_the_least_recently_used_simulator_stops_and_starts_again_when_needed() -> None:
    pool = TargetPool(max_live=2)
    try:
        first = pool.get("8.0", "replicaset")
        pool.get("9.1", "replicaset")
        assert pool.get("8.0", "replicaset") is first, "a live target is reused"
        pool.get("6.0", "replicaset")  # 9.1 is now the least recently used
        assert pool.live() == [("8.0", "replicaset"), ("6.0", "replicaset")]
        assert pool.started == 3
        assert _answers(first.uri, "8.0")
        again = pool.get("9.1", "replicaset")  # stops 8.0
        assert pool.live() == [("6.0", "replicaset"), ("9.1", "replicaset")]
        assert pool.started == 4 and again.info.version[:2] == (9, 1)
        assert not _answers(first.uri, "8.0"), "a stopped simulator no longer answers"
    finally:
        pool.close()
    assert pool.live() == []


def test_a_pool_that_could_keep_no_simulator_running_is_refused() -> None:
    with pytest.raises(RunnerError, match="at least 1 simulator running, not 0"):
        TargetPool(max_live=0)
