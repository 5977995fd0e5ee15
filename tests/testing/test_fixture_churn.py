"""Fixture churn (issue 22, deliverable 5): ``stop()`` ends every thread of the deployment
before it returns, so a test suite that starts and stops a deployment per test holds no
threads, descriptors or memory for the ones it stopped."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from bson.timestamp import Timestamp

from changestream.testing import ReplicaSet, ShardedCluster
from tests.support import raw_command


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _used(rs: ReplicaSet) -> None:
    """A request on a worker, a change stream that took the event cache and closed."""
    member = rs.members[0]
    raw_command(member, {"insert": "c", "documents": [{"_id": 1}], "$db": "db"})
    reply = raw_command(
        member,
        {"aggregate": "c", "pipeline": [{"$changeStream": {"startAtOperationTime": Timestamp(1, 0)}}],
         "cursor": {}, "$db": "db"},
    )  # fmt: skip
    cid = reply.get("cursor", {}).get("id")
    if cid:
        raw_command(member, {"killCursors": "c", "cursors": [cid], "$db": "db"})


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_200_deployments_started_and_stopped_leave_nothing_behind() -> None:
    for _ in range(5):  # warm up: imports, caches, the allocator
        with ReplicaSet("8.0", noop_interval=0.05) as rs:
            _used(rs)
    threads, fds, rss = threading.active_count(), _fds(), _rss_mb()
    for i in range(200):
        with ReplicaSet("8.0", members=1 + i % 3, noop_interval=0.05) as rs:
            _used(rs)
        left = threading.active_count() - threads
        assert left <= 0, f"after deployment {i}: {left} threads outlived stop(): " + ", ".join(
            sorted(t.name for t in threading.enumerate())
        )
    assert _fds() <= fds, "descriptors leaked"
    assert _rss_mb() - rss < 40, f"RSS grew {_rss_mb() - rss:.1f} MB over 200 deployments"


def test_a_stopped_sharded_cluster_leaves_no_thread() -> None:
    before = {t.ident for t in threading.enumerate()}
    with ShardedCluster("8.0", shards=2, mongoses=2, load_balancer=True, noop_interval=0.05) as c:
        raw_command(c.mongoses[0], {"insert": "c", "documents": [{"_id": 1}], "$db": "db"})
    left = [t.name for t in threading.enumerate() if t.ident not in before]
    assert left == []
