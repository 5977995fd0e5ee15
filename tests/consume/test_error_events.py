"""An ``operationType: "error"`` event is never applied as data by ``consume``.

Such events are reported for MongoDB 9.1 (``showErrorsAsEvents``) but are not in mongod's
source and the simulator cannot produce one, so the tests make one with a pipeline stage
that rewrites ``operationType`` of a chosen insert: it travels the real stream and machine.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import bson
import pytest
from bson.raw_bson import RawBSONDocument
from pymongo import AsyncMongoClient, MongoClient

import changestream
import changestream.aio
from changestream import NotResumableError, OnError
from changestream.stores import MemoryTokenStore

FAST = {"max_await_time_ms": 50}
# every insert of a document with bad: true arrives as an error event
AS_ERROR = [{"$set": {"operationType": {
    "$cond": [{"$eq": ["$fullDocument.bad", True]}, "error", "$operationType"]}}}]


def op(change: Any) -> Any:
    return change.get("operationType") if isinstance(change, dict) else change.operation_type


def start_token(coll: Any) -> Any:
    with changestream.watch(coll, **FAST) as stream:
        return stream.resume_token


@pytest.fixture
def coll(mongo_client: MongoClient[dict[str, Any]], names: tuple[str, str]) -> Any:
    return mongo_client[names[0]][names[1]]


def run_consume(coll: Any, stop_after: int, **options: Any) -> tuple[list[Any], Any, Any]:
    """consume from before three inserts (the middle one an error event)."""
    store = MemoryTokenStore()
    store.save(start_token(coll))
    coll.insert_many([{"_id": 1}, {"_id": 2, "bad": True}, {"_id": 3}])
    handled: list[Any] = []
    stop = threading.Event()
    lock = threading.Lock()

    def handler(change: Any) -> None:
        with lock:
            handled.append(change)
            if len(handled) >= stop_after:
                stop.set()

    result: Any = None
    try:
        result = changestream.consume(coll, handler, store, pipeline=AS_ERROR,
                                      watch_options=FAST, stop=stop, retry_for=5, **options)
    except NotResumableError as exc:
        result = exc
    return handled, result, store


@pytest.mark.parametrize("workers", [1, 4])
def test_an_error_event_stops_the_run_before_it_with_one_line(coll: Any, workers: int) -> None:
    handled, result, store = run_consume(coll, stop_after=3, workers=workers)
    assert isinstance(result, NotResumableError), result
    message = str(result)
    assert "\n" not in message and "operationType 'error'" in message
    assert "not applied" in message
    assert [c["documentKey"]["_id"] for c in handled] == [1]  # never the error event, nor after
    stored = store.load()
    assert stored is not None and stored.token == handled[0]["_id"]  # before the event
    assert result.token == handled[0]["_id"]


@pytest.mark.parametrize("workers", [1, 4])
def test_dead_letter_takes_an_error_event_with_its_token(coll: Any, workers: int) -> None:
    letters: list[tuple[Any, BaseException]] = []
    handled, result, _ = run_consume(
        coll, stop_after=2, workers=workers,
        on_error=OnError(retries=3, dead_letter=lambda c, e: letters.append((c, e))))
    assert not isinstance(result, BaseException), result
    assert sorted(c["documentKey"]["_id"] for c in handled) == [1, 3]
    assert len(letters) == 1
    change, exc = letters[0]
    assert op(change) == "error" and change["documentKey"] == {"_id": 2}
    assert isinstance(exc, NotResumableError) and exc.token == change["_id"]
    assert result.handled == 3  # a dead-lettered change counts as handled


def test_typed_stream_error_event_is_an_unknown_event_at_the_dead_letter(coll: Any) -> None:
    store = MemoryTokenStore()
    store.save(start_token(coll))
    coll.insert_many([{"_id": 1, "bad": True}, {"_id": 2}])
    letters: list[Any] = []
    stop = threading.Event()
    changestream.consume(
        lambda token: changestream.watch(coll, AS_ERROR, resume_after=token, typed=True, **FAST),
        lambda change: stop.set(), store, stop=stop,
        on_error=OnError(dead_letter=lambda c, e: letters.append(c)))
    assert len(letters) == 1
    assert type(letters[0]) is changestream.events.UnknownEvent
    assert letters[0].operation_type == "error" and letters[0].resume_token is not None


def test_async_consume_stops_at_an_error_event(mongodb_uri: str, names: tuple[str, str]) -> None:
    async def main() -> Any:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongodb_uri)
        try:
            coll = client[names[0]][names[1]]
            async with await changestream.aio.watch(coll, **FAST) as stream:
                token = stream.resume_token
            store = MemoryTokenStore()
            store.save(token)
            await coll.insert_many([{"_id": 1}, {"_id": 2, "bad": True}])
            handled: list[Any] = []
            with pytest.raises(NotResumableError, match="operationType 'error'"):
                await changestream.aio.consume(coll, handled.append, store, pipeline=AS_ERROR,
                                               watch_options=FAST, retry_for=5)
            return handled
        finally:
            await client.close()

    handled = asyncio.run(main())
    assert [c["documentKey"]["_id"] for c in handled] == [1]


# -- the Spark source: its fetcher stops at an error event, after what came before -----------
def test_spark_fetcher_stops_with_a_clear_error_at_an_error_event(coll: Any) -> None:
    pytest.importorskip("pyarrow", reason="the Spark adapter needs the spark extra")
    from changestream.spark_adapter._convert import is_error_event
    from changestream.spark_adapter._prefetch import Prefetcher

    token = start_token(coll)
    coll.insert_many([{"_id": 1}, {"_id": 2, "bad": True}, {"_id": 3}])
    stream = changestream.watch(coll, AS_ERROR, resume_after=token, **FAST)

    def reopen(after: Any) -> Any:
        return changestream.watch(coll, AS_ERROR, resume_after=after, **FAST)

    with Prefetcher(stream, reopen, lambda e: e, max_rows=100, max_bytes=1 << 20) as fetch:
        assert fetch.wait(lambda: fetch.stopped is not None, 30)
    stream.close()
    assert [e["documentKey"]["_id"] for e in fetch.events] == [1]  # not the event, nor after
    stopped = fetch.stopped
    assert stopped is not None and isinstance(stopped.error, NotResumableError)
    assert "\n" not in str(stopped.error) and "operationType 'error'" in str(stopped.error)
    # every form a Spark event takes, and data that merely mentions the word
    doc = {"_id": {"_data": "82"}, "operationType": "error"}
    data = {"_id": {"_data": "82"}, "operationType": "insert",
            "fullDocument": {"operationType": "error"}}
    for form in (dict, lambda d: bson.encode(d), lambda d: RawBSONDocument(bson.encode(d))):
        assert is_error_event(form(doc)) and not is_error_event(form(data))


# -- the Delta sink (the CLI's mirror) ----------------------------------------------------------
def test_merge_ready_refuses_an_error_event_even_without_a_document_key() -> None:
    error = {"_id": {"_data": "8201"}, "operationType": "error", "ns": {"db": "d", "coll": "c"}}
    with pytest.raises(ValueError, match="operationType 'error'"):
        changestream.merge_ready([error])


def test_mirror_through_consume_stops_before_an_error_event(coll: Any, tmp_path: Any) -> None:
    """What ``changestream mirror`` runs: consume with the DeltaSink as handler and store."""
    pytest.importorskip("deltalake", reason='needs pip install "changestream[delta]"')
    from changestream.delta import DeltaSink

    token = start_token(coll)
    sink = DeltaSink(tmp_path / "t", app_id="m")
    coll.insert_many([{"_id": 1}, {"_id": 2, "bad": True}, {"_id": 3}])
    with pytest.raises(NotResumableError, match="operationType 'error'"):
        changestream.consume(
            lambda t: changestream.watch(coll, AS_ERROR, resume_after=t or token, **FAST),
            sink, sink, save_every=1, retry_for=5)
    rows = sink.read_current().to_pylist()
    assert [row["_key"] for row in rows] == ["1"]  # only the change before the event
