"""``changestream.consume``: at-least-once handling, token saves, reopen with backoff, dead ends."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import bson
import pytest
from bson.raw_bson import RawBSONDocument
from pymongo import MongoClient
from pymongo.errors import (
    AutoReconnect,
    ConnectionFailure,
    ExecutionTimeout,
    NetworkTimeout,
    OperationFailure,
    ServerSelectionTimeoutError,
)

import changestream
from changestream._consumer.retry import is_transient
from changestream.stores import FileTokenStore, MemoryTokenStore, StoredToken

FAST = {"max_await_time_ms": 50}


def same(a: Any, b: Any) -> bool:
    return bson.encode(a) == bson.encode(b)


class RecordingStore(MemoryTokenStore):
    """Remembers every saved token, in order."""

    def __init__(self, initial: StoredToken | None = None) -> None:
        super().__init__(initial)
        self.tokens: list[Any] = []

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        super().save(token, batch_id=batch_id)
        self.tokens.append(token)


class Consumer:
    """Runs ``consume`` in a thread; ``stop_after`` changes set the stop event."""

    def __init__(self, coll: Any, store: Any, stop_after: int, **options: Any) -> None:
        self.coll = coll
        self.store = store
        self.stop_after = stop_after
        self.options = options
        self.changes: list[Any] = []
        self.tokens: list[Any] = []
        self.opened: list[Any] = []
        self.stop = threading.Event()
        self.ready = threading.Event()
        """Set once a stream is open: what is written after it is seen."""
        self.result: Any = None
        self.error: BaseException | None = None
        self.on_change: Callable[[Any], None] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def open_stream(self, token: Any) -> changestream.ChangeStream[Any]:
        self.opened.append(token)
        stream = changestream.watch(self.coll, resume_after=token, **FAST)
        self.ready.set()
        return stream

    def handle(self, change: Any) -> None:
        if self.on_change is not None:
            self.on_change(change)
        self.changes.append(change)
        if len(self.changes) >= self.stop_after:
            self.stop.set()

    def _run(self) -> None:
        try:
            self.result = changestream.consume(self.open_stream, self.handle, self.store,
                                               stop=self.stop, **self.options)
        except BaseException as exc:
            self.error = exc

    def start(self) -> Consumer:
        self.thread.start()
        # Not a fixed sleep: on a loaded machine the initial aggregate can take longer,
        # and changes written before it would never be seen.
        deadline = time.monotonic() + 60
        while not self.ready.wait(0.02) and self.thread.is_alive():
            assert time.monotonic() < deadline, "the stream did not open"
        return self

    def join(self, timeout: float = 60) -> Consumer:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "consume() did not stop"
        return self

    def values(self) -> list[Any]:
        return [c["fullDocument"]["i"] for c in self.changes if c["operationType"] == "insert"]


@pytest.fixture
def admin(mongo_client: MongoClient[dict[str, Any]]) -> MongoClient[dict[str, Any]]:
    """The shared ``names`` fixture (tests/conftest.py) creates its collection on this client."""
    return mongo_client


@pytest.fixture
def coll(mongo_client: MongoClient[dict[str, Any]], names: tuple[str, str]) -> Any:
    return mongo_client[names[0]][names[1]]



def token_before_writes(coll: Any) -> Any:
    with changestream.watch(coll, **FAST) as stream:
        return stream.resume_token


# -- the happy path and the save schedule ------------------------------------------------------
def test_every_change_is_handled_and_its_token_stored(coll: Any, tmp_path: Path) -> None:
    store = FileTokenStore(tmp_path / "token.json")
    consumer = Consumer(coll, store, stop_after=5).start()
    coll.insert_many([{"i": i} for i in range(5)])
    consumer.join()
    assert consumer.error is None and consumer.values() == [0, 1, 2, 3, 4]
    stored = store.load()
    assert stored is not None and same(stored.token, consumer.result.token)
    assert consumer.result.handled == 5 and consumer.result.reopens == 0
    # A restart from the file sees only what came later.
    coll.insert_one({"i": 5})
    again = Consumer(coll, store, stop_after=1).start().join()
    assert again.values() == [5] and same(again.opened[0], stored.token)


@pytest.mark.parametrize("option", ["resume_after", "start_after", "start_at_operation_time"])
def test_a_start_option_in_watch_options_starts_the_first_run_and_the_stored_token_wins_after(
    coll: Any, option: str,
) -> None:
    """``resume_after`` there was a bare TypeError (given twice); ``start_after`` and
    ``start_at_operation_time`` reached the server beside the stored token on a restart,
    which refuses two start options: a consumer could not restart."""
    with changestream.watch(coll, **FAST) as stream:
        coll.insert_one({"i": -1})  # before the start: not handled
        first = stream.next()
    start = first["clusterTime"] if option == "start_at_operation_time" else first["_id"]
    if option == "start_at_operation_time":  # (inclusive: the event at that time comes again)
        start = bson.Timestamp(start.time, start.inc + 1)
    coll.insert_many([{"i": i} for i in range(3)])
    store = MemoryTokenStore()

    def run(count: int) -> list[Any]:
        seen: list[Any] = []
        stop = threading.Event()

        def handle(change: Any) -> None:
            seen.append(change["fullDocument"]["i"])
            if len(seen) == count:
                stop.set()

        changestream.consume(coll, handle, store, stop=stop, save_every=1,
                             watch_options={option: start, **FAST})
        return seen

    assert run(2) == [0, 1]
    coll.insert_one({"i": 3})
    assert run(2) == [2, 3]  # from the stored token, not from the start option again


def test_tokens_are_saved_every_n_changes_and_after_empty_batches(coll: Any) -> None:
    start = token_before_writes(coll)
    coll.insert_many([{"i": i} for i in range(7)])
    store = RecordingStore(StoredToken(start, None, changestream.stores._now()))
    ids: list[Any] = []
    consumer = Consumer(coll, store, stop_after=10**9, save_every=3)
    consumer.on_change = lambda change: ids.append(change["_id"])

    def stop_when_idle() -> None:
        while len(ids) < 7 or len(store.tokens) < 3:
            time.sleep(0.01)
        consumer.stop.set()

    threading.Thread(target=stop_when_idle, daemon=True).start()
    consumer.start().join()
    assert consumer.values() == list(range(7))
    # Saved after the 3rd and the 6th change, never in between ...
    saved_ids = [i for i, id_ in enumerate(ids) if any(same(id_, t) for t in store.tokens)]
    assert saved_ids[:2] == [2, 5] and set(saved_ids) <= {2, 5, 6}
    # ... then the 7th when the next batch came back empty; the end of the run saved the rest.
    assert len(store.tokens) >= 3
    stored = store.load()
    assert stored is not None and same(stored.token, consumer.result.token)


def test_save_interval_saves_a_slow_trickle(coll: Any) -> None:
    store = RecordingStore()
    consumer = Consumer(coll, store, stop_after=3, save_every=1000, save_interval=0.0)
    consumer.start()
    saves_before = len(store.tokens)
    coll.insert_many([{"i": i} for i in range(3)])
    consumer.join()
    assert consumer.values() == [0, 1, 2]
    assert len(store.tokens) - saves_before >= 3


# -- at least once --------------------------------------------------------------------------------
def test_at_least_once_across_a_server_restart(simulator: Any, tmp_path: Path) -> None:
    store = FileTokenStore(tmp_path / "token.json")
    with MongoClient(simulator.uri) as client, MongoClient(simulator.uri) as writer:
        coll = client.db.orders
        consumer = Consumer(coll, store, stop_after=6)
        # The only member restarts in the middle: connections drop, cursors die.
        consumer.on_change = lambda change: (
            simulator.step_down() if change["fullDocument"]["i"] == 2 else None
        )
        consumer.start()
        writer.db.orders.insert_many([{"i": i} for i in range(3)])
        while len(consumer.changes) < 3:
            time.sleep(0.01)
        writer.db.orders.insert_many([{"i": i} for i in range(3, 6)])
        consumer.join()
        assert consumer.error is None, consumer.error
        assert consumer.values() == [0, 1, 2, 3, 4, 5]
        stored = store.load()
        assert stored is not None and same(stored.token, consumer.result.token)


def test_a_failing_handler_keeps_the_last_handled_token(coll: Any) -> None:
    store = MemoryTokenStore()
    consumer = Consumer(coll, store, stop_after=10)

    def fail_on_third(change: Any) -> None:
        if change["fullDocument"]["i"] == 2:
            raise RuntimeError("handler bug")

    consumer.on_change = fail_on_third
    consumer.start()
    coll.insert_many([{"i": i} for i in range(4)])
    consumer.join()
    assert isinstance(consumer.error, RuntimeError) and consumer.values() == [0, 1]
    # The next run starts right after the last handled change: change 2 comes again.
    again = Consumer(coll, store, stop_after=2).start().join()
    assert again.values() == [2, 3]


# -- transient failures: reopen with backoff -----------------------------------------------------
def test_reopens_with_backoff_when_the_single_resume_fails(
    coll: Any, fail_point: Callable[..., None], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="changestream.consume")
    consumer = Consumer(coll, MemoryTokenStore(), stop_after=2, backoff_initial=0.2,
                        backoff_max=1.0).start()
    coll.insert_one({"i": 0})
    while not consumer.changes:
        time.sleep(0.01)
    # getMore, the resume aggregate and its retry fail: the stream gives up; the
    # first reopen (aggregate + retry) fails too, so consume() backs off once.
    fail_point({"times": 5}, failCommands=["getMore", "aggregate"], closeConnection=True)
    started = time.monotonic()
    while len(consumer.opened) < 3 and time.monotonic() - started < 10:
        time.sleep(0.01)
    coll.insert_one({"i": 1})
    consumer.join()
    assert consumer.error is None, consumer.error
    assert consumer.values() == [0, 1]
    assert consumer.result.reopens == 2
    # Both reopens start from the last handled position: at or after change 0, never before.
    first = changestream.token_cluster_time(consumer.changes[0]["_id"])
    assert same(consumer.opened[1], consumer.opened[2])
    assert first is not None and changestream.token_cluster_time(consumer.opened[1]) >= first
    waits = [float(r.getMessage().split(" in ")[1].split(" s")[0]) for r in caplog.records
             if "reopening from the last handled token in" in r.getMessage()]
    assert len(waits) == 1 and 0.2 <= waits[0] <= 0.4


def test_gives_up_after_retry_for_without_looping(coll: Any,
                                                  fail_point: Callable[..., None]) -> None:
    fail_point("alwaysOn", failCommands=["aggregate"], closeConnection=True)
    opened: list[Any] = []

    def open_stream(token: Any) -> changestream.ChangeStream[Any]:
        opened.append(token)
        return changestream.watch(coll, resume_after=token, **FAST)

    started = time.monotonic()
    with pytest.raises(changestream.RetriesExhaustedError) as info:
        changestream.consume(open_stream, lambda change: None, MemoryTokenStore(),
                             retry_for=0.6, backoff_initial=0.05, backoff_max=0.2)
    elapsed = time.monotonic() - started
    assert 0.6 <= elapsed < 5
    assert 2 <= len(opened) <= 15
    assert "run again once the deployment is reachable" in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionFailure)


# -- dead ends: stop at once, say how to recover -----------------------------------------------------
def test_history_lost_stops_at_once_with_recovery_advice(tmp_path: Path) -> None:
    if os.environ.get("MONGODB_URI"):
        pytest.skip("needs the simulator's small oplog (MONGODB_URI points at a real deployment)")
    from changestream.testing import ReplicaSet

    with ReplicaSet("8.0", oplog_max_entries=20) as rs, MongoClient(rs.uri) as client:
        coll = client.db.orders
        store = FileTokenStore(tmp_path / "token.json")
        store.save(token_before_writes(coll))
        coll.insert_many([{"i": i} for i in range(50)])  # the token's entry rolls off
        consumer = Consumer(coll, store, stop_after=1)
        consumer.thread.start()
        consumer.join()
    error = consumer.error
    assert isinstance(error, changestream.HistoryLostError)
    assert isinstance(error.__cause__, OperationFailure) and error.__cause__.code == 286
    assert len(consumer.opened) == 1 and consumer.changes == []
    message = str(error)
    assert "history lost" in message and "start_at_operation_time" in message
    assert str(tmp_path / "token.json") in message


def test_invalidate_stops_and_its_token_starts_a_new_stream(coll: Any) -> None:
    store = MemoryTokenStore()
    consumer = Consumer(coll, store, stop_after=10).start()
    coll.insert_one({"i": 0})
    coll.drop()
    consumer.join()
    error = consumer.error
    assert isinstance(error, changestream.StreamInvalidatedError)
    assert [c["operationType"] for c in consumer.changes] == ["insert", "drop"]
    assert "start_after" in str(error)
    stored = store.load()
    assert stored is not None and same(stored.token, consumer.changes[-1]["_id"])
    # Restarting from the store hits the invalidate again: a clear stop, not a loop.
    again = Consumer(coll, store, stop_after=10)
    again.thread.start()
    again.join()
    assert isinstance(again.error, changestream.StreamInvalidatedError)
    assert len(again.opened) == 1 and again.changes == []
    coll.insert_one({"i": 1})
    with changestream.watch(coll, start_after=error.invalidate_token, **FAST) as stream:
        assert stream.next()["fullDocument"]["i"] == 1


@pytest.mark.parametrize(
    ("code", "expected"),
    [(13, "not authorized"), (280, "not in this deployment's change history")],
)
def test_server_refusals_stop_at_once(coll: Any, fail_point: Callable[..., None], code: int,
                                      expected: str) -> None:
    fail_point({"times": 1}, failCommands=["aggregate"], errorCode=code)
    opened: list[Any] = []

    def open_stream(token: Any) -> changestream.ChangeStream[Any]:
        opened.append(token)
        return changestream.watch(coll, resume_after=token, **FAST)

    with pytest.raises(changestream.NotResumableError) as info:
        changestream.consume(open_stream, lambda change: None, MemoryTokenStore())
    assert expected in str(info.value) and len(opened) == 1


def test_options_are_checked(coll: Any) -> None:
    def never(token: Any) -> Any:
        raise AssertionError("no stream may be opened")

    for bad in ({"save_every": 0}, {"save_interval": -1}, {"backoff_initial": 2.0,
                                                             "backoff_max": 1.0},
                {"retry_for": -1}):
        with pytest.raises(ValueError):
            changestream.consume(never, print, MemoryTokenStore(), **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (AutoReconnect("connection closed"), True),
        (NetworkTimeout("timed out"), True),
        (ServerSelectionTimeoutError("no primary"), True),
        (ExecutionTimeout("operation exceeded time limit", 50), True),
        (OperationFailure("shutting down", 91), True),
        (OperationFailure("x", 43), True),
        (OperationFailure("x", 999, {"errorLabels": ["ResumableChangeStreamError"]}), True),
        (OperationFailure("lost", 286, {"errorLabels": ["NonResumableChangeStreamError"]}), False),
        (OperationFailure("unauthorized", 13), False),
        # killCursors on a cursor: 43 on the next getMore, 237 if one was running; same outcome
        (OperationFailure("killed", 237), True),
        (OperationFailure("interrupted", 11601), False),
        (ValueError("handler bug"), False),
    ],
)
def test_transient_classification(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def test_a_token_travels_as_its_event_bytes_until_it_is_read(coll: Any) -> None:
    """consume keeps the token after each change as the raw event's bytes (no copy, no
    decode per change: one in save_every is stored); whatever reads it gets the stream's
    token, also for a poll without a change that left the last event's token (a server
    without postBatchResumeToken)."""
    from changestream._consumer.run import SAVE, Run
    from changestream._metrics import StatsReporter

    stream = changestream.watch(coll, max_await_time_ms=50)
    coll.insert_many([{"_id": 1}, {"_id": 2}])
    change = stream.next()
    carried = stream.carried_token()
    assert type(carried) is bytes  # the first change of a batch: its token is in the event
    run = Run(MemoryTokenStore(), save_every=100, save_interval=None, retry_for=None,
              backoff_initial=0.1, backoff_max=1.0, stats=StatsReporter(None, 60.0))
    run.started(stream)
    assert run.handled(carried) is not SAVE
    assert type(run.progress.token) is dict and run.progress.token == change["_id"]
    run.progress.saved()
    assert run.polled(None, carried, True) is not SAVE  # the same position: nothing new
    second = stream.next()
    assert run.polled(None, stream.carried_token(), True) is SAVE
    assert run.progress.token == second["_id"] and type(run.progress.token) is dict
    stream.close()


@pytest.mark.parametrize("workers", [1, 4])
def test_events_of_a_large_reply_are_handled_and_their_tokens_stored(
    coll: Any, workers: int
) -> None:
    """PyMongo's sync client hands a reply over about 64 KiB over as a memoryview and its
    raw events as views into it (issue 33, item 1): consume stopped with "token must be a
    document (mapping), not memoryview" ("cannot pickle memoryview objects" with workers)
    at the first save, so events of 100 kB (or a split event's neighbours) never got past."""
    store = RecordingStore()
    store.save(token_before_writes(coll))
    coll.insert_many([{"i": i, "pad": "x" * 100_000} for i in range(6)])
    consumer = Consumer(coll, store, stop_after=6, workers=workers).start().join()
    assert consumer.error is None, consumer.error
    assert sorted(consumer.values()) == list(range(6)) and consumer.result.handled == 6
    stored = store.load()
    assert stored is not None and type(stored.token) is dict
    assert same(stored.token, consumer.result.token)
    assert all(type(token) is dict for token in store.tokens)


def test_transient_handler_errors_are_retried_for_retry_for_before_on_error_counts() -> None:
    """Issue 33, item 6, both twins: a ConnectionError or a transient PyMongo error in the
    handler is retried (the run's backoff) for retry_for; then it counts as an attempt; on
    a stop it is raised as is, never dead-lettered."""
    import asyncio

    from changestream._consumer.handler_errors import HandlerCalls, TransientBudget
    from changestream._sync._sync_io import call_handler
    from changestream.aio._async_io import call_handler as async_call_handler

    def calls_with(retry_for: float) -> tuple[HandlerCalls, list[Any]]:
        letters: list[Any] = []
        policy = changestream.OnError(retries=0, backoff_initial=0,
                                      dead_letter=lambda c, e: letters.append((c, type(e))))
        return HandlerCalls(policy, TransientBudget(retry_for, 0.01, 0.02)), letters

    def failing(times: int, error: BaseException) -> Callable[[Any], None]:
        left = [times]

        def handler(change: Any) -> None:
            if left[0]:
                left[0] -= 1
                raise error

        return handler

    for run in (call_handler,
                lambda h, c, calls: asyncio.run(async_call_handler(h, c, calls))):
        calls, letters = calls_with(retry_for=30)
        run(failing(3, ConnectionResetError("reset")), "a", calls)
        run(failing(2, AutoReconnect("failover")), "b", calls)
        assert letters == [] and calls.retries == 5
        run(failing(1, ValueError("poison")), "c", calls)  # not transient: on_error's
        assert letters == [("c", ValueError)]
        calls, letters = calls_with(retry_for=0.05)  # an outage longer than retry_for
        run(failing(1000, AutoReconnect("down")), "d", calls)
        assert letters == [("d", AutoReconnect)]
        calls, letters = calls_with(retry_for=30)
        calls.stop = threading.Event()
        calls.stop.set()  # stopping during an outage: raised, handled again after a restart
        with pytest.raises(AutoReconnect):
            run(failing(1000, AutoReconnect("down")), "e", calls)
        assert letters == []


def test_a_store_that_recovered_still_gets_the_last_token_on_the_way_out(coll: Any) -> None:
    """A save failed once (transient: the stream reopened), later saves worked; when the
    handler then fails, the last handled token is still flushed (the first failure is not
    held against the store for the rest of the run)."""
    start = token_before_writes(coll)
    coll.insert_many([{"i": i} for i in range(6)])

    class FlakyStore(RecordingStore):
        failures = 1

        def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
            if self.failures:
                self.failures -= 1
                raise AutoReconnect("the token store's primary stepped down")
            super().save(token, batch_id=batch_id)

    store = FlakyStore(StoredToken(start, None, changestream.stores._now()))
    handled: list[Any] = []

    def handler(change: Any) -> None:
        if change["fullDocument"]["i"] == 5:
            raise ValueError("handler bug")
        handled.append(change["_id"])

    with pytest.raises(ValueError, match="handler bug"):
        changestream.consume(lambda token: changestream.watch(coll, resume_after=token, **FAST),
                             handler, store, save_every=2, backoff_initial=0.01)
    assert store.failures == 0, "the first save failed"
    stored = store.load()
    assert stored is not None and same(stored.token, handled[-1]), (
        "the change handled before the failing one is stored")


def test_the_carried_token_of_a_large_event_is_presented_only_when_asked(coll: Any) -> None:
    """``bson`` hands an event over 4 KiB over as a view into its reply: the machine copies its
    token out, and ``carried_token`` gives that raw copy (was: decoded to the stream's
    document class per change, though consume presents only the one it stores)."""
    start = token_before_writes(coll)
    coll.insert_many([{"i": i, "pad": "x" * 5000} for i in range(3)])
    with changestream.watch(coll, resume_after=start, **FAST) as stream:
        change = stream.next()
        assert change["fullDocument"]["i"] == 0
        carried = stream.carried_token()
        assert type(carried) is RawBSONDocument and type(carried.raw) is bytes
        presented = stream.present_token(carried)
        assert type(presented) is dict and same(presented, change["_id"])
        assert same(stream.resume_token, presented)


# -- reading ahead (changestream._read_ahead) ---------------------------------------------------
def test_a_collection_is_read_ahead_in_batches_of_2000_and_every_change_is_handled_once(
        mongodb_uri: str, coll: Any) -> None:
    """``consume`` asks for the next batch while its handler works through this one (the
    server builds it meanwhile), in getMore batches of 2,000 unless ``batch_size`` is set;
    every change is still handled once, in order, and the last token is stored."""
    from support import Recorder

    recorder = Recorder()
    observed: MongoClient[dict[str, Any]] = MongoClient(mongodb_uri, event_listeners=[recorder])
    try:
        start = token_before_writes(coll)
        total = 6_000
        for first in range(0, total, 1_000):
            coll.insert_many([{"i": i} for i in range(first, first + 1_000)])
        handled: list[int] = []
        getmores_mid_batch: list[int] = []
        stop = threading.Event()

        def handle(change: Any) -> None:
            handled.append(change["fullDocument"]["i"])
            if len(handled) == 2_500:  # inside the first getMore's batch (2,001-4,000)
                deadline = time.monotonic() + 10
                while recorder.names().count("getMore") < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                getmores_mid_batch.append(recorder.names().count("getMore"))
            if len(handled) == total:
                stop.set()

        store = MemoryTokenStore()
        result = changestream.consume(observed[coll.database.name][coll.name], handle, store,
                                      stop=stop, watch_options={"resume_after": start, **FAST})
        assert handled == list(range(total))
        assert getmores_mid_batch == [2], recorder.names()  # the next one was already asked
        assert {command.get("batchSize") for command in recorder.commands("getMore")} == {2_000}
        assert recorder.commands("aggregate")[0]["cursor"] == {"batchSize": 2_000}
        stored = store.load()
        assert stored is not None and same(stored.token, result.token)
        assert result.handled == total
    finally:
        observed.close()


def test_a_stop_inside_a_buffered_batch_ends_after_that_change_and_the_next_run_goes_on(
        coll: Any) -> None:
    """The changes of a batch already fetched are handled in one call (no poll per change);
    a stop set by the handler still ends the run right after that change, its token stored,
    and the next run starts with the change after it: none lost, none twice."""
    start = token_before_writes(coll)
    coll.insert_many([{"i": i} for i in range(100)])
    store = MemoryTokenStore(StoredToken(start, None, changestream.stores._now()))
    handled: list[int] = []
    stop = threading.Event()

    def handle(change: Any) -> None:
        handled.append(change["fullDocument"]["i"])
        if len(handled) == 37:  # mid-batch: the 100 inserts come in one batch
            stop.set()

    changestream.consume(coll, handle, store, stop=stop, save_every=1_000, watch_options=FAST)
    assert handled == list(range(37))
    rest: list[int] = []
    again = threading.Event()

    def handle_rest(change: Any) -> None:
        rest.append(change["fullDocument"]["i"])
        if len(rest) == 63:
            again.set()

    changestream.consume(coll, handle_rest, store, stop=again, watch_options=FAST)
    assert rest == list(range(37, 100))
