"""Fixture churn (issue 22, deliverable 5): ``stop()`` ends every thread of the deployment
before it returns, so a test suite that starts and stops a deployment per test holds no
threads, descriptors or memory for the ones it stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pymongo
import pytest
from bson.timestamp import Timestamp

from changestream.testing import ReplicaSet, ShardedCluster
from changestream.testing.core import event_cache
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


def churn(deployments: int = 200) -> None:
    """Start and stop ``deployments`` replica sets; raise if a thread, a descriptor or memory
    outlives them."""
    for _ in range(5):  # warm up: imports, caches, the allocator
        with ReplicaSet("8.0", noop_interval=0.05) as rs:
            _used(rs)
    threads, fds, rss = threading.active_count(), _fds(), _rss_mb()
    for i in range(deployments):
        with ReplicaSet("8.0", members=1 + i % 3, noop_interval=0.05) as rs:
            _used(rs)
        left = threading.active_count() - threads
        assert left <= 0, f"after deployment {i}: {left} threads outlived stop(): " + ", ".join(
            sorted(t.name for t in threading.enumerate())
        )
    assert _fds() <= fds, "descriptors leaked"
    assert _rss_mb() - rss < 40, f"RSS grew {_rss_mb() - rss:.1f} MB over 200 deployments"


def _in_own_process(function: str, *args: int) -> None:
    """Run this module's ``function(*args)`` in a new interpreter: the threads it counts are
    then its deployments' alone. In the suite's process, other tests' deployments live on
    (the session's replica set), and a leaked client's cursor, collected meanwhile, makes one
    of them start an idle timer or a worker that would be counted as a stopped deployment's."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", f"from tests.testing.test_fixture_churn import {function}; "
         f"{function}(*{args!r})"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_200_deployments_started_and_stopped_leave_nothing_behind() -> None:
    _in_own_process("churn")


def test_a_stopped_sharded_cluster_leaves_no_thread() -> None:
    _in_own_process("sharded_cluster_churn")


def sharded_cluster_churn() -> None:
    before = {t.ident for t in threading.enumerate()}
    with ShardedCluster("8.0", shards=2, mongoses=2, load_balancer=True, noop_interval=0.05) as c:
        raw_command(c.mongoses[0], {"insert": "c", "documents": [{"_id": 1}], "$db": "db"})
    left = [t.name for t in threading.enumerate() if t.ident not in before]
    assert left == []


def _simulator_threads(before: set[int | None]) -> list[str]:
    """Threads started since ``before`` that are not PyMongo's (``pymongo_*``: a closed
    MongoClient signals its monitors and kill-cursors thread, which end on their next wake,
    about half a second later; they belong to the client, not to the deployment)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.ident not in before and not t.name.startswith("pymongo")
    )


@pytest.mark.parametrize("deployments", [
    20,  # every path: 1, 2 and 3 members, clients closed before and (twice) after the stop
    pytest.param(100, marks=pytest.mark.slow),  # the same paths, many times over: endurance
])
def test_deployments_with_pymongo_clients_leave_no_simulator_thread(deployments: int) -> None:
    """Issue 33, item 11: after ``stop()`` returns, no thread the deployment started is alive,
    with PyMongo's own change streams and monitors on it (awaitable hellos, getMores)."""
    _in_own_process("pymongo_churn", deployments)


def pymongo_churn(deployments: int = 100) -> None:
    before = {t.ident for t in threading.enumerate()}
    for i in range(deployments):
        open_at_stop = i % 10 == 0
        with ReplicaSet("8.0", members=1 + i % 3, noop_interval=0.05) as rs:
            client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
                # closed after the stop, a client waits this long to send endSessions
                rs.uri, serverSelectionTimeoutMS=500 if open_at_stop else 5000
            )
            with client.db.c.watch(max_await_time_ms=50) as stream:
                client.db.c.insert_one({"i": i})
                assert stream.next()["operationType"] == "insert"
            if not open_at_stop:
                client.close()  # as a fixture does; every tenth stays open through the stop
        left = _simulator_threads(before)
        client.close()
        assert left == [], f"after deployment {i}: {left} outlived stop()"


def test_the_event_cache_joins_an_idle_timer_started_while_it_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream released on a worker while the deployment stops: ``close()`` must not meet an
    idle timer that is made but not started (it could not join it, and the timer would start
    after ``stop()`` returned)."""
    cache = event_cache.EventCache(idle_seconds=60)
    cache.put(1, "shape", ["event"], 10)
    release = cache.acquire()
    closed = threading.Event()
    errors: list[BaseException] = []
    closers: list[threading.Thread] = []

    def close() -> None:
        try:
            cache.close()
        except BaseException as exc:
            errors.append(exc)
        closed.set()

    class Timer(threading.Timer):
        def start(self) -> None:
            closer = threading.Thread(target=close)
            closers.append(closer)
            closer.start()
            closed.wait(0.5)  # the old code's close() ran here, between making and starting
            super().start()

    monkeypatch.setattr(event_cache.threading, "Timer", Timer)
    before = {t.ident for t in threading.enumerate()}
    release()
    assert closed.wait(5)
    closers[0].join(5)
    assert errors == []
    assert [t.name for t in threading.enumerate() if t.ident not in before] == []
