"""``consume(workers=N)``, ``on_error`` and ``on_history_lost`` on the simulator (sync loop).

Per-key order, barriers and the low watermark through the real loop and a
real stream; poison changes retried, dead-lettered or stopping with the token
before them; lost history recovered from now (with the gap reported) or by a
new snapshot. The async twin: ``test_aio_consume_workers.py``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import bson
import pytest
from pymongo import MongoClient

import changestream
from changestream.stores import FileTokenStore, MemoryTokenStore, StoredToken

FAST = {"max_await_time_ms": 50}


def same(a: Any, b: Any) -> bool:
    return bson.encode(a) == bson.encode(b)


@pytest.fixture
def coll(mongo_client: MongoClient[dict[str, Any]], names: tuple[str, str]) -> Any:
    return mongo_client[names[0]][names[1]]


@pytest.fixture
def admin(mongo_client: MongoClient[dict[str, Any]]) -> MongoClient[dict[str, Any]]:
    return mongo_client


def start_token(coll: Any) -> Any:
    with changestream.watch(coll, **FAST) as stream:
        return stream.resume_token


def stored_at(token: Any) -> MemoryTokenStore:
    return MemoryTokenStore(StoredToken(token, None, changestream.stores._now()))


class Tracker:
    """A handler that records what ran, checks per-key order, and knows which tokens are safe."""

    def __init__(self, expected: int, delay: float = 0.002, seed: int = 7) -> None:
        self.lock = threading.Lock()
        self.expected = expected
        self.rng = random.Random(seed)
        self.delay = delay
        self.started: list[Any] = []
        self.finished: set[bytes] = set()
        self.running: dict[Any, int] = {}
        self.concurrent_max = 0
        self.problems: list[str] = []
        self.stop = threading.Event()

    def __call__(self, change: Mapping[str, Any]) -> None:
        key = change.get("documentKey", {}).get("_id", "barrier")
        with self.lock:
            if key in self.running or (self.running and key == "barrier"):
                self.problems.append(f"{key} ran beside {sorted(map(str, self.running))}")
            if "barrier" in self.running:
                self.problems.append(f"{key} ran beside a barrier")
            self.running[key] = 1
            self.concurrent_max = max(self.concurrent_max, len(self.running))
            self.started.append(change)
            delay = self.rng.random() * self.delay
        time.sleep(delay)
        with self.lock:
            del self.running[key]
            self.finished.add(bson.encode(change["_id"]))
            if len(self.finished) >= self.expected:
                self.stop.set()

    def versions(self) -> dict[Any, list[int]]:
        seen: dict[Any, list[int]] = {}
        for change in self.started:
            if change["operationType"] == "insert":
                seen.setdefault(change["documentKey"]["_id"], []).append(0)
            elif change["operationType"] == "update":
                version = change["updateDescription"]["updatedFields"]["v"]
                seen.setdefault(change["documentKey"]["_id"], []).append(version)
        return seen


class CheckingStore(MemoryTokenStore):
    """Asserts at every save that no change at or before the saved token is unhandled."""

    def __init__(self, initial: StoredToken | None, tracker: Tracker, order: list[bytes]) -> None:
        super().__init__(initial)
        self.tracker = tracker
        self.order = order
        """The change tokens in stream order (filled as the writer knows them)."""
        self.violations: list[str] = []
        self.saves = 0

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        encoded = bson.encode(token)
        with self.tracker.lock:
            if encoded in self.order:
                position = self.order.index(encoded)
                missing = [p for p in range(position + 1)
                           if self.order[p] not in self.tracker.finished]
                if missing:
                    self.violations.append(f"saved token {position} with {missing[:3]} unhandled")
        self.saves += 1
        super().save(token, batch_id=batch_id)


def writes(coll: Any, documents: int, updates: int) -> None:
    coll.insert_many([{"_id": i, "v": 0} for i in range(documents)])
    for version in range(1, updates + 1):
        for i in range(documents):
            coll.update_one({"_id": i}, {"$set": {"v": version}})


def tokens_in_order(coll: Any, start: Any, count: int) -> list[bytes]:
    order = []
    with changestream.watch(coll, resume_after=start, **FAST) as stream:
        while len(order) < count:
            change = stream.try_next()
            if change is not None:
                order.append(bson.encode(change["_id"]))
    return order


def test_workers_keep_per_key_order_and_never_store_past_an_unhandled_change(coll: Any) -> None:
    start = start_token(coll)
    writes(coll, documents=12, updates=15)  # 12 inserts + 180 updates
    total = 12 * 16
    tracker = Tracker(total)
    store = CheckingStore(None, tracker, tokens_in_order(coll, start, total))
    store.save(start)
    result = changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token, **FAST), tracker, store,
        stop=tracker.stop, workers=8,
    )
    assert not tracker.problems, tracker.problems[:3]
    assert not store.violations, store.violations[:3]
    assert result.handled == total and len(tracker.started) == total
    for key, versions in tracker.versions().items():
        assert versions == list(range(16)), f"document {key} out of order: {versions}"
    assert tracker.concurrent_max > 1, "the handlers never overlapped"
    stored = store.load()
    assert stored is not None and same(stored.token, result.token)
    assert type(result.token) is dict and type(stored.token) is dict  # as without workers
    assert bson.encode(result.token) == store.order[-1] or store.order[-1] in tracker.finished


def test_a_change_without_document_key_runs_alone_after_everything_before_it(coll: Any) -> None:
    start = start_token(coll)
    coll.insert_many([{"_id": i} for i in range(30)])
    coll.drop()  # a drop event (no documentKey), then invalidate
    tracker = Tracker(expected=10**9)
    store = stored_at(start)
    with pytest.raises(changestream.StreamInvalidatedError) as info:
        changestream.consume(
            lambda token: changestream.watch(coll, resume_after=token, **FAST), tracker, store,
            workers=8,
        )
    assert not tracker.problems, tracker.problems[:3]
    kinds = [c["operationType"] for c in tracker.started]
    assert kinds[-1] == "drop" and kinds.count("insert") == 30
    stored = store.load()
    drop = tracker.started[-1]
    assert stored is not None and same(stored.token, drop["_id"])
    assert same(info.value.token, drop["_id"])
    assert type(info.value.token) is dict and type(info.value.invalidate_token) is dict


def test_max_in_flight_bounds_fetching_behind_one_slow_change(coll: Any) -> None:
    start = start_token(coll)
    coll.insert_many([{"_id": i} for i in range(40)])
    release = threading.Event()
    handled: list[int] = []
    lock = threading.Lock()

    def handle(change: Any) -> None:
        if change["documentKey"]["_id"] == 0:
            release.wait(30)
        with lock:
            handled.append(change["documentKey"]["_id"])

    stop = threading.Event()
    store = stored_at(start)
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token, **FAST), handle, store,
        stop=stop, workers=4, max_in_flight=6)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while len(handled) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # room to fetch more, if the bound did not hold
    with lock:
        assert sorted(handled) == [1, 2, 3, 4, 5], "fetched past max_in_flight"
    assert same(store.load().token, start)  # type: ignore[union-attr]
    stop.set()
    release.set()
    thread.join(30)
    # The admitted changes finished on stop (6, or 7 if the waiting fetch got its room first).
    assert result and result[0].handled in (6, 7)
    assert sorted(handled) == list(range(result[0].handled))


def test_stop_while_waiting_for_room_at_max_in_flight_returns_within_drain_timeout(
    coll: Any,
) -> None:
    start = start_token(coll)
    coll.insert_many([{"_id": i} for i in range(40)])
    release = threading.Event()
    handled: list[int] = []
    lock = threading.Lock()

    def handle(change: Any) -> None:
        if change["documentKey"]["_id"] == 0:
            release.wait(60)  # one stuck call holds the watermark: the window fills
        with lock:
            handled.append(change["documentKey"]["_id"])

    stop = threading.Event()
    store = stored_at(start)
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token, **FAST), handle, store,
        stop=stop, workers=4, max_in_flight=6, drain_timeout=1)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while len(handled) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the loop now waits for room behind change 0
    stopped = time.monotonic()
    stop.set()
    thread.join(15)
    took = time.monotonic() - stopped
    release.set()
    assert result, "consume ignored stop while waiting for room at max_in_flight"
    assert took < 10
    # The stuck call never finished in time: the stored token is still before it.
    assert same(store.load().token, start)  # type: ignore[union-attr]


def test_stop_lets_admitted_changes_finish_within_drain_timeout(coll: Any) -> None:
    start = start_token(coll)
    coll.insert_many([{"_id": i} for i in range(20)])
    started = threading.Event()
    stop = threading.Event()

    def handle(change: Any) -> None:
        started.set()
        stop.set()  # stop at once: the admitted changes still finish
        time.sleep(0.05)

    store = stored_at(start)
    result = changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token, **FAST), handle, store,
        stop=stop, workers=4, drain_timeout=30)
    assert started.is_set() and result.handled >= 1
    stored = store.load()
    assert stored is not None and same(stored.token, result.token)
    # The rest comes after a restart, nothing is lost (5 more: the first run may have
    # admitted all 20 before a handler thread set stop, and then the rest is only these).
    coll.insert_many([{"_id": i} for i in range(20, 25)])
    rest: list[int] = []
    stop2 = threading.Event()

    def collect(change: Any) -> None:
        rest.append(change["documentKey"]["_id"])
        if len(rest) + result.handled >= 25:
            stop2.set()

    changestream.consume(lambda token: changestream.watch(coll, resume_after=token, **FAST),
                         collect, store, stop=stop2, workers=4)
    assert sorted(rest) == list(range(result.handled, 25))


def test_a_poison_change_stops_with_the_token_before_it(coll: Any) -> None:
    start = start_token(coll)
    coll.insert_many([{"_id": i} for i in range(20)])
    calls: list[int] = []

    def handle(change: Any) -> None:
        calls.append(change["documentKey"]["_id"])
        if change["documentKey"]["_id"] == 7:
            raise ValueError("poison")

    store = stored_at(start)
    stats: list[changestream.ConsumeStats] = []
    with pytest.raises(ValueError, match="poison"):
        changestream.consume(
            lambda token: changestream.watch(coll, resume_after=token, **FAST), handle, store,
            workers=4, on_error=changestream.OnError(retries=2, backoff_initial=0.01),
            on_stats=stats.append)
    assert calls.count(7) == 3 and stats[-1].retries == 2 and stats[-1].dead_letters == 0
    # The stored token is before change 7 (exactly change 6's, after every earlier change).
    with changestream.watch(coll, resume_after=store.load().token, **FAST) as stream:  # type: ignore[union-attr]
        first = None
        while first is None:
            first = stream.try_next()
    assert first["documentKey"]["_id"] == 7


@pytest.mark.parametrize("workers", [1, 4])
def test_dead_letter_takes_the_poison_change_and_the_run_goes_on(coll: Any, workers: int) -> None:
    start = start_token(coll)
    coll.insert_many([{"_id": i} for i in range(10)])
    letters: list[tuple[int, str]] = []
    handled: list[int] = []
    stop = threading.Event()

    def handle(change: Any) -> None:
        if change["documentKey"]["_id"] == 3:
            raise RuntimeError("cannot handle 3")
        handled.append(change["documentKey"]["_id"])
        if len(handled) == 9:
            stop.set()

    policy = changestream.OnError(
        retries=1, backoff_initial=0,
        dead_letter=lambda change, exc: letters.append((change["documentKey"]["_id"], str(exc))))
    stats: list[changestream.ConsumeStats] = []
    result = changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token, **FAST), handle,
        stored_at(start), stop=stop, workers=workers, on_error=policy, on_stats=stats.append)
    assert letters == [(3, "cannot handle 3")]
    assert sorted(handled) == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert result.handled == 10  # the dead-lettered change counts as handled
    assert stats[-1].dead_letters == 1 and stats[-1].retries == 1


@pytest.mark.parametrize(("options", "message"), [
    ({"workers": 0}, "workers must be an integer from 1"),
    ({"workers": True}, "workers must be an integer from 1"),
    ({"workers": 2, "max_in_flight": 0}, "max_in_flight must be an integer >= 1"),
    ({"drain_timeout": -1}, "drain_timeout must be a number of seconds >= 0"),
    ({"on_error": 3}, "on_error must be a changestream.OnError"),
    ({"on_history_lost": "ignore"}, "on_history_lost must be one of"),
    ({"on_history_lost": "from_now"}, "pass gap=function"),
    ({"on_history_lost": "resnapshot"}, "needs the collection itself"),
    ({"workers": 2, "key": "documentKey"}, "key must be a function"),
])
def test_bad_options_are_one_clear_error(coll: Any, options: dict[str, Any],
                                         message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        changestream.consume(lambda token: changestream.watch(coll), lambda change: None,
                             MemoryTokenStore(), **options)


# -- lost history ------------------------------------------------------------------------------
def small_oplog() -> Any:
    if os.environ.get("MONGODB_URI"):
        pytest.skip("needs the simulator's small oplog (MONGODB_URI points at a real deployment)")
    from changestream.testing import ReplicaSet

    return ReplicaSet("8.0", oplog_max_entries=20)


@pytest.mark.parametrize("workers", [1, 4])
def test_history_lost_from_now_reports_the_gap_and_goes_on(tmp_path: Path, workers: int) -> None:
    with small_oplog() as rs, MongoClient(rs.uri) as client:
        coll = client.db.orders
        store = FileTokenStore(tmp_path / "token.json")
        store.save(start_token(coll))
        coll.insert_many([{"i": i} for i in range(50)])  # the token's entry rolls off
        gaps: list[changestream.HistoryGap] = []
        seen: list[int] = []
        stop = threading.Event()
        opened = threading.Event()

        def handle(change: Any) -> None:
            seen.append(change["fullDocument"]["i"])
            stop.set()

        def open_stream(token: Any) -> Any:
            stream = changestream.watch(coll, resume_after=token, **FAST)
            if token is None:
                opened.set()
            return stream

        def write_later() -> None:
            opened.wait(30)
            time.sleep(0.2)
            coll.insert_one({"i": 100})

        threading.Thread(target=write_later, daemon=True).start()
        changestream.consume(open_stream, handle, store, stop=stop, workers=workers,
                             on_history_lost="from_now", gap=gaps.append)
    assert seen == [100]  # the lost 50 are skipped, the stream goes on from now
    assert len(gaps) == 1 and gaps[0].action == "from_now"
    assert gaps[0].lost_after is not None and gaps[0].resumed_at is not None
    assert gaps[0].lost_after <= gaps[0].resumed_at


def test_history_lost_resnapshot_copies_the_collection_again(tmp_path: Path) -> None:
    with small_oplog() as rs, MongoClient(rs.uri) as client:
        coll = client.db.orders
        store = FileTokenStore(tmp_path / "token.json")
        store.save(start_token(coll))
        coll.insert_many([{"_id": i} for i in range(50)])
        seen: list[Any] = []
        bounds: list[str] = []
        gaps: list[changestream.HistoryGap] = []
        stop = threading.Event()

        def handle(change: Any) -> None:
            if change["operationType"] in ("snapshotStart", "snapshotEnd"):
                bounds.append(change["operationType"])  # where the new copy begins and ends
                if change["operationType"] == "snapshotEnd":
                    stop.set()
                return
            seen.append(change)

        changestream.consume(coll, handle, store, stop=stop, workers=4,
                             on_history_lost="resnapshot", gap=gaps.append,
                             watch_options=FAST)
    assert bounds[0] == "snapshotStart" and bounds[-1] == "snapshotEnd"
    assert sorted(c["documentKey"]["_id"] for c in seen) == list(range(50))
    assert all("snapshot" in c for c in seen), "snapshot records are marked"
    assert [g.action for g in gaps] == ["resnapshot"]


# -- what the workers work with: typed events, split events, snapshots, stores, the LB --------
def test_typed_events_keep_per_key_order(coll: Any) -> None:
    start = start_token(coll)
    writes(coll, documents=6, updates=8)
    total = 6 * 9
    seen: dict[Any, list[int]] = {}
    lock = threading.Lock()
    stop = threading.Event()
    count = 0

    def handle(event: Any) -> None:
        nonlocal count
        assert isinstance(event, changestream.events.ChangeEvent)
        time.sleep(random.random() * 0.002)
        version = 0 if event.operation_type == "insert" else (
            event.update_description.updated_fields["v"])
        with lock:
            seen.setdefault(event.document_key["_id"], []).append(version)
            count += 1
            if count == total:
                stop.set()

    result = changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token, typed=True, **FAST), handle,
        stored_at(start), stop=stop, workers=6)
    assert result.handled == total
    assert all(versions == list(range(9)) for versions in seen.values()), seen


def test_split_events_reach_the_workers_reassembled(
        mongo_client: MongoClient[dict[str, Any]], names: tuple[str, str]) -> None:
    database = mongo_client[names[0]]
    database.drop_collection(names[1])
    coll = database.create_collection(names[1], changeStreamPreAndPostImages={"enabled": True})
    big = 10 * 1024 * 1024
    coll.insert_one({"_id": 1, "value": "q" * big})
    start = start_token(coll)
    coll.update_one({"_id": 1}, {"$set": {"value": "z" * big}})
    coll.insert_one({"_id": 2})
    seen: list[Any] = []
    stop = threading.Event()

    def handle(change: Any) -> None:
        seen.append(change)
        if len(seen) == 2:
            stop.set()

    changestream.consume(
        lambda token: changestream.watch(coll, [{"$changeStreamSplitLargeEvent": {}}],
                                         resume_after=token, full_document_before_change="required",
                                         reassemble_split_events=True,
                                         **FAST),
        handle, stored_at(start), stop=stop, workers=4)
    update = next(c for c in seen if c["operationType"] == "update")
    assert "splitEvent" not in update
    assert len(update["fullDocumentBeforeChange"]["value"]) == big
    assert len(update["updateDescription"]["updatedFields"]["value"]) == big


def test_initial_snapshot_records_run_in_parallel_by_id_then_the_changes(
        coll: Any, tmp_path: Path) -> None:
    coll.insert_many([{"_id": i, "v": 0} for i in range(200)])
    store = FileTokenStore(tmp_path / "snap.json")
    seen: dict[Any, list[int]] = {}
    records = 0
    lock = threading.Lock()
    stop = threading.Event()
    copied = threading.Event()

    def handle(change: Any) -> None:
        nonlocal records
        time.sleep(random.random() * 0.001)
        with lock:
            key = change["documentKey"]["_id"]
            if "snapshot" in change:
                records += 1
                seen.setdefault(key, []).append(0)
                if records == 200:
                    copied.set()
            else:
                seen.setdefault(key, []).append(change["updateDescription"]["updatedFields"]["v"])
                if sum(len(v) for v in seen.values()) == 400:
                    stop.set()

    def update_after_the_copy() -> None:
        copied.wait(60)
        for i in range(200):
            coll.update_one({"_id": i}, {"$set": {"v": 1}})

    threading.Thread(target=update_after_the_copy, daemon=True).start()
    result = changestream.consume(coll, handle, store, initial_snapshot=True, workers=8,
                                  stop=stop, watch_options=FAST)
    assert records == 200 and result.handled == 400
    assert all(versions == [0, 1] for versions in seen.values())
    stored = store.load()
    assert stored is not None and "snapshot" not in str(stored.token.get("_data"))


def test_mongo_token_store_with_workers(coll: Any, mongo_client: MongoClient[dict[str, Any]],
                                        names: tuple[str, str]) -> None:
    from changestream.stores import MongoTokenStore

    store = MongoTokenStore(mongo_client[names[0]]["positions"], "parallel")
    store.save(start_token(coll))
    coll.insert_many([{"_id": i} for i in range(50)])
    stop = threading.Event()
    handled: list[int] = []

    def handle(change: Any) -> None:
        handled.append(change["documentKey"]["_id"])
        if len(handled) == 50:
            stop.set()

    result = changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token, **FAST), handle, store,
        stop=stop, workers=8)
    assert sorted(handled) == list(range(50))
    stored = store.load()
    assert stored is not None and same(stored.token, result.token)


def test_workers_through_a_load_balancer() -> None:
    if os.environ.get("MONGODB_URI"):
        pytest.skip("needs the simulator's load balancer (MONGODB_URI points at a real deployment)")
    from changestream.testing import ShardedCluster

    with ShardedCluster("8.0", shards=2, mongoses=2, load_balancer=True,
                        noop_interval=0.2) as cluster:
        MongoClient(cluster.mongos_uri(0), directConnection=True).admin.command(
            "shardCollection", "lb.c", key={"_id": "hashed"})
        with MongoClient(cluster.lb_uri) as client:
            coll = client.lb.c
            start = start_token(coll)
            coll.insert_many([{"_id": i % 10, "n": i} if i < 10 else {"_id": 100 + i}
                              for i in range(40)])
            for i in range(10):
                coll.update_one({"_id": i}, {"$set": {"n": 1000 + i}})
            stop = threading.Event()
            handled: list[Any] = []
            lock = threading.Lock()

            def handle(change: Any) -> None:
                time.sleep(random.random() * 0.002)
                with lock:
                    handled.append((change["documentKey"]["_id"], change["operationType"]))
                    if len(handled) == 50:
                        stop.set()

            changestream.consume(
                lambda token: changestream.watch(coll, resume_after=token, **FAST), handle,
                stored_at(start), stop=stop, workers=8)
    assert len(handled) == 50
    for i in range(10):
        kinds = [kind for key, kind in handled if key == i]
        assert kinds == ["insert", "update"], (i, kinds)


def test_history_lost_mid_stream_with_workers_never_stores_the_old_position(
        coll: Any, fail_point: Any) -> None:
    start = start_token(coll)
    coll.insert_many([{"_id": i} for i in range(5)])
    store = RecordingStore(start)
    gaps: list[changestream.HistoryGap] = []
    handled: list[int] = []
    stop = threading.Event()

    before: set[bytes] = {bson.encode(start)}

    def handle(change: Any) -> None:
        handled.append(change["documentKey"]["_id"])
        if not gaps:
            before.add(bson.encode(change["_id"]))
        if len(handled) == 5:  # the next getMore says the history is lost
            fail_point({"times": 1}, failCommands=["getMore"], errorCode=286)
            threading.Thread(target=coll.insert_many,
                             args=([{"_id": i} for i in range(5, 10)],)).start()
        if change["documentKey"]["_id"] == 100:
            stop.set()

    def gap(lost: changestream.HistoryGap) -> None:
        gaps.append(lost)
        store.after_gap = len(store.tokens)
        coll.insert_one({"_id": 100})  # the new stream's first getMore brings a change

    changestream.consume(lambda token: changestream.watch(coll, resume_after=token, **FAST),
                         handle, store, stop=stop, workers=4, on_history_lost="from_now", gap=gap)
    assert len(gaps) == 1 and 100 in handled
    later = [bson.encode(t) for t in store.tokens[store.after_gap:]]
    assert later and not before & set(later), "a position from before the lost history was stored"


class RecordingStore(MemoryTokenStore):
    def __init__(self, start: Any) -> None:
        super().__init__(StoredToken(start, None, changestream.stores._now()))
        self.tokens: list[Any] = []
        self.after_gap = 0

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        super().save(token, batch_id=batch_id)
        self.tokens.append(token)


class SlowSavingStore(MemoryTokenStore):
    """Saves slowly (handlers end meanwhile) and records which change each save stored."""

    def __init__(self, start: Any, order: list[bytes], lock: threading.Lock) -> None:
        super().__init__(StoredToken(start, None, changestream.stores._now()))
        self.order = order
        self.lock = lock
        self.stored = -1
        """Index in ``order`` of the stored change (-1: the start token)."""

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        time.sleep(0.005)
        super().save(token, batch_id=batch_id)
        encoded = bson.encode(token)
        with self.lock:
            if encoded in self.order:
                self.stored = max(self.stored, self.order.index(encoded))


def test_a_crash_redelivers_at_most_max_in_flight_even_while_saves_are_slow(coll: Any) -> None:
    """The window counts from the stored token: calls that end while the store writes
    must not make room for more than ``max_in_flight`` changes past it."""
    start = start_token(coll)
    total, max_in_flight = 400, 8
    coll.insert_many([{"_id": i} for i in range(total)])
    order = tokens_in_order(coll, start, total)
    lock = threading.Lock()
    store = SlowSavingStore(start, order, lock)
    stop = threading.Event()
    widest = 0

    def handle(change: Any) -> None:
        nonlocal widest
        with lock:
            # handled past the stored token: what a crash now would deliver again
            widest = max(widest, order.index(bson.encode(change["_id"])) - store.stored)
        time.sleep(0.0005)
        if change["documentKey"]["_id"] == total - 1:
            stop.set()

    result = changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token, **FAST), handle, store,
        stop=stop, workers=4, max_in_flight=max_in_flight,
    )
    assert result.handled == total
    assert 1 < widest <= max_in_flight, widest


@pytest.mark.parametrize("workers", [1, 4])
def test_a_stop_after_the_last_change_does_not_wait_for_the_getmore_in_flight(
    coll: Any, workers: int
) -> None:
    """A long await makes the old wait plain: the stop waited for the getMore to come back
    (the sync stream now kills the cursor aside when closed from the stop's thread)."""
    slow_await = {"max_await_time_ms": 10_000}
    start = start_token(coll)
    coll.insert_many([{"_id": i} for i in range(20)])
    stop = threading.Event()
    handled: list[int] = []
    stopped_at: list[float] = []
    lock = threading.Lock()

    def handle(change: Any) -> None:
        with lock:
            handled.append(change["documentKey"]["_id"])
            last = len(handled) == 20
        if last:
            threading.Timer(0.2, lambda: (stopped_at.append(time.monotonic()), stop.set())).start()

    store = stored_at(start)
    changestream.consume(lambda token: changestream.watch(coll, resume_after=token, **slow_await),
                         handle, store, stop=stop, workers=workers)
    waited = time.monotonic() - stopped_at[0]
    assert sorted(handled) == list(range(20))
    assert waited < 5, f"the stop waited {waited:.1f} s for the getMore's await"
    # Nothing lost: the stored token is after the last change, and the stream goes on.
    coll.insert_one({"_id": 20})
    with changestream.watch(coll, resume_after=store.load().token, **FAST) as stream:  # type: ignore[union-attr]
        first = None
        while first is None:
            first = stream.try_next()
    assert first["documentKey"]["_id"] == 20


def test_changes_of_a_document_whose_id_is_nan_run_one_at_a_time_in_order(coll: Any) -> None:
    """Issue 33, item 4: NaN != NaN gave each change of one document its own lane."""
    start = start_token(coll)
    coll.insert_one({"_id": float("nan"), "v": 0})
    for version in range(1, 8):
        coll.update_one({"_id": float("nan")}, {"$set": {"v": version}})
    lock, stop = threading.Lock(), threading.Event()
    running, overlaps, versions = [0], [0], []

    def handler(change: Mapping[str, Any]) -> None:
        with lock:
            running[0] += 1
            overlaps[0] = max(overlaps[0], running[0])
            fields = change.get("updateDescription", {}).get("updatedFields", {"v": 0})
            versions.append(fields["v"])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
            if len(versions) == 8:
                stop.set()

    changestream.consume(lambda token: changestream.watch(coll, resume_after=token, **FAST),
                         handler, stored_at(start), stop=stop, workers=8)
    assert overlaps[0] == 1 and versions == list(range(8))


@pytest.mark.parametrize("workers", [1, 4])
def test_an_outage_of_the_handlers_database_dead_letters_nothing(
    coll: Any, workers: int, mongodb_uri: str
) -> None:
    """Issue 33, item 6: a 1.5 s outage of the handler's own database dead-lettered healthy
    changes (on_error counted each transient failure as an attempt). Transient errors are
    retried with the run's backoff for retry_for before on_error counts one."""
    start = start_token(coll)
    coll.insert_many([{"_id": i} for i in range(8)])
    target: MongoClient[dict[str, Any]] = MongoClient(mongodb_uri, retryWrites=False)
    sink = target[coll.database.name][coll.name + "_sink"]
    letters: list[Any] = []
    stop, lock = threading.Event(), threading.Lock()
    control: MongoClient[dict[str, Any]] = MongoClient(mongodb_uri)  # not the failing client
    admin = control.admin
    admin.command("configureFailPoint", "failCommand", mode="alwaysOn",
                  data={"failCommands": ["insert"], "closeConnection": True})
    outage = threading.Timer(1.5, lambda: admin.command("configureFailPoint", "failCommand",
                                                        mode="off"))

    done: list[Any] = []

    def settled(change: Any, exc: BaseException | None = None) -> None:
        if exc is not None:
            letters.append(change)
        with lock:
            done.append(change)
            if len(done) == 8:
                stop.set()

    def handle(change: Any) -> None:
        sink.insert_one({"_id": change["documentKey"]["_id"]})
        settled(change)

    stats: list[changestream.ConsumeStats] = []
    outage.start()
    try:
        changestream.consume(
            lambda token: changestream.watch(coll, resume_after=token, **FAST), handle,
            stored_at(start), stop=stop, workers=workers, backoff_initial=0.1, backoff_max=0.5,
            retry_for=30,
            on_error=changestream.OnError(retries=1, backoff_initial=0,
                                          dead_letter=settled),
            on_stats=stats.append)
    finally:
        outage.cancel()
        admin.command("configureFailPoint", "failCommand", mode="off")
        target.close()
        control.close()
    assert letters == []
    assert sorted(d["_id"] for d in coll.database[coll.name + "_sink"].find()) == list(range(8))
    assert stats[-1].dead_letters == 0 and stats[-1].retries >= 1
