"""The reported lag against the truth, on the simulator, at the default batch size.

The truth at a moment ``t`` is ``t`` minus the ``wallTime`` of the oldest change
written by then and not yet handled (0 if there is none). The simulator runs in
this process, so its wall clock is ours; the client never reads a wall clock
for the lag (only cluster times and its monotonic clock). Every sample of
``stream.lag`` / ``ConsumeStats.lag`` must be within :data:`TOLERANCE` of the
truth: while a big backlog drains, with a writer faster than the handler,
idle, and through one shard being down. Before the fix the lag read 0 while a
backlog drained; each test checks that its truth was large enough for that to
fail.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta, timezone
from typing import Any

import pytest
from pymongo import MongoClient

import changestream
from changestream.stores import MemoryTokenStore
from changestream.testing import ReplicaSet, ShardedCluster

TOLERANCE = 2.0
"""Seconds the reported lag may differ from the truth (cluster times have 1 s resolution)."""


def wall() -> float:
    return time.time()


@dataclasses.dataclass
class Truth:
    """Handled changes (their ``wallTime`` and when they were handled) and lag samples."""

    handled: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    samples: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """``(wall time of the sample, reported lag in seconds)``."""

    def handle(self, change: Any) -> None:
        when = change["wallTime"].replace(tzinfo=timezone.utc).timestamp()
        self.handled.append((when, wall()))

    def sample(self, lag: timedelta | None) -> None:
        if lag is not None:
            self.samples.append((wall(), lag.total_seconds()))

    def truth_at(self, at: float) -> float:
        pending = [written for written, done in self.handled if written <= at < done]
        return at - min(pending) if pending else 0.0

    def check(self, *, at_least: float) -> str:
        """Every sample within TOLERANCE of the truth; the truth reached ``at_least`` s."""
        assert self.samples, "no lag was reported"
        rows = [(at, lag, self.truth_at(at)) for at, lag in self.samples]
        worst = max(rows, key=lambda r: abs(r[1] - r[2]))
        largest = max(truth for _, _, truth in rows)
        summary = (
            f"{len(rows)} samples, {len(self.handled)} changes; largest true lag "
            f"{largest:.1f} s; worst: reported {worst[1]:.2f} s vs true {worst[2]:.2f} s"
        )
        assert abs(worst[1] - worst[2]) <= TOLERANCE, summary
        assert largest >= at_least, f"the scenario never fell {at_least} s behind: {summary}"
        print(f"\n{summary}")
        return summary


def insert_batches(coll: Any, batches: int, size: int, pause: float = 0.0) -> None:
    for b in range(batches):
        coll.insert_many([{"b": b, "i": i, "pad": "x" * 100} for i in range(size)])
        if pause:
            time.sleep(pause)


@pytest.fixture
def replset() -> Any:
    with ReplicaSet("8.0") as rs:
        yield rs


def test_a_backlog_drained_at_the_default_batch_size_reports_its_true_lag(replset: Any) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(replset.uri)
    coll = client.db.c
    coll.insert_one({"setup": True})
    truth = Truth()
    with changestream.watch(coll) as stream:
        stream.try_next()
        insert_batches(coll, 15, 100)  # 1,500 changes: one getMore brings them all
        deadline = time.monotonic() + 60
        while len(truth.handled) < 1500 and time.monotonic() < deadline:
            change = stream.try_next()
            if change is None:
                truth.sample(stream.lag)
                continue
            if len(truth.handled) % 50 == 49:
                truth.sample(stream.lag)  # while the change is being handled
            time.sleep(0.002)  # an I/O-like handler: about 3 s for the backlog
            truth.handle(change)
        for _ in range(3):  # caught up: 0 again
            stream.try_next()
        truth.sample(stream.lag)
        assert stream.lag is not None and stream.lag <= timedelta(seconds=1)
    client.close()
    truth.check(at_least=3.0)


def test_a_fast_writer_and_a_slow_consumer_report_the_true_lag_then_idle_reads_zero(
    replset: Any,
) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(replset.uri)
    coll = client.db.c
    coll.insert_one({"setup": True})
    truth = Truth()
    total = 1500
    writing = threading.Event()
    writing.set()

    def write() -> None:  # faster than the handler, for as long as the handler is measured
        b = 0
        while writing.is_set():
            coll.insert_many([{"b": b, "i": i, "pad": "x" * 100} for i in range(50)])
            b += 1
            time.sleep(0.05)

    writer = threading.Thread(target=write, daemon=True)
    with changestream.watch(coll) as stream:
        stream.try_next()
        writer.start()
        deadline = time.monotonic() + 60
        while len(truth.handled) < total and time.monotonic() < deadline:
            change = stream.try_next()
            if change is None:
                truth.sample(stream.lag)
                continue
            if len(truth.handled) % 25 == 0:
                truth.sample(stream.lag)  # while the change is being handled
            time.sleep(0.003)  # slower than the writer
            truth.handle(change)
        writing.clear()
        writer.join()
        while stream.try_next() is not None:  # drain what is left, unmeasured
            pass
        idle_until = time.monotonic() + 3
        while time.monotonic() < idle_until:  # idle: nothing written, nothing behind
            assert stream.try_next() is None
            truth.sample(stream.lag)
        idle = [sample[1] for sample in truth.samples[-3:]]
        assert max(idle) <= 1.0, idle
    client.close()
    truth.check(at_least=2.0)


def test_stats_keep_coming_through_a_shard_outage_with_the_true_lag() -> None:
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0.2) as cluster:
        client: MongoClient[dict[str, Any]] = MongoClient(cluster.uri, serverSelectionTimeoutMS=3000)
        coll = client.db.c
        coll.insert_one({"setup": True})
        primary = client.config.databases.find_one({"_id": "db"})
        assert primary is not None
        names = cluster.shard_names
        other = cluster.shards[1 - names.index(primary["primary"])]
        truth = Truth()
        reports: list[tuple[float, changestream.ConsumeStats]] = []
        stop = threading.Event()

        def on_stats(stats: changestream.ConsumeStats) -> None:
            reports.append((wall(), stats))
            truth.sample(stats.lag)

        def write() -> None:
            while not stop.is_set():
                coll.insert_one({"at": wall()})  # the unsharded collection: the live shard
                time.sleep(0.02)

        consumer = threading.Thread(
            target=changestream.consume,
            args=(lambda token: changestream.watch(coll, resume_after=token), truth.handle,
                  MemoryTokenStore()),
            kwargs={"stop": stop, "on_stats": on_stats, "stats_interval": 0.5,
                    "backoff_initial": 0.2, "backoff_max": 1.0, "call_timeout": 5.0},
            daemon=True,
        )
        consumer.start()
        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        time.sleep(2)
        down_at = wall()
        other.kill_member(0)
        time.sleep(6)
        up_at = wall()
        other.restart_member(0)
        time.sleep(4)
        stop.set()
        writer.join()
        consumer.join(30)
        client.close()
    during = [stats for at, stats in reports if down_at + 1 <= at <= up_at]
    assert len(during) >= 6, f"{len(during)} reports during a 6 s outage"
    lags = [s.lag.total_seconds() for s in during if s.lag is not None]
    assert lags and max(lags) >= 4.0, f"the lag did not grow through the outage: {lags}"
    truth.check(at_least=4.0)

