"""The ``changestream-async`` mode's pieces that need no server: bridge, streams, mirrors, ids."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient, ReadPreference
from pymongo.errors import ExecutionTimeout, OperationFailure
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from spec_tests.runner import RunnerError
from spec_tests.runner.adapter import (
    ASYNC_CLIENT,
    CLIENTS,
    DEFAULT_CLIENTS,
    id_suffix,
    needs_bridge,
    open_change_stream,
)
from spec_tests.runner.async_bridge import AsyncBridge, BridgedStream
from spec_tests.runner.entities import ClientEntity, EntityMap
from spec_tests.runner.errors import check_expected_error
from spec_tests.runner.events import EventRecorder
from spec_tests.runner.matrix import Case
from spec_tests.runner.operations import next_with_limit
from spec_tests.test_unified import ASYNC_DEFAULT_VERSIONS, client_impls, is_slow

UNREACHABLE = "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=100"
"""Loopback port 1: nothing listens, so monitors fail at once and no command ever runs."""


@pytest.fixture
def bridge() -> Iterator[AsyncBridge]:
    bridge = AsyncBridge()
    yield bridge
    assert bridge.close() == []


# -- running coroutines ---------------------------------------------------------------------------


def test_results_come_back_and_the_loop_runs_in_its_own_thread(bridge: AsyncBridge) -> None:
    async def where() -> str:
        await asyncio.sleep(0)
        return threading.current_thread().name

    assert bridge.run(where()) == "spec-tests-async-bridge"


def test_async_server_errors_keep_code_labels_and_cause(bridge: AsyncBridge) -> None:
    reply = {
        "ok": 0,
        "code": 280,
        "codeName": "ChangeStreamFatalError",
        "errmsg": "boom",
        "errorLabels": ["NonResumableChangeStreamError"],
    }

    async def fail() -> None:
        try:
            raise OperationFailure("boom", 280, reply)
        except OperationFailure as inner:
            raise RuntimeError("library wrapper") from inner

    with pytest.raises(RuntimeError) as caught:
        bridge.run(fail())
    check_expected_error(
        {
            "isClientError": False,
            "errorCode": 280,
            "errorLabelsContain": ["NonResumableChangeStreamError"],
        },
        caught.value,
        None,  # type: ignore[arg-type]
    )


def test_async_timeouts_are_timeout_errors(bridge: AsyncBridge) -> None:
    async def slow() -> None:
        raise ExecutionTimeout("late", 50, {"ok": 0, "code": 50, "codeName": "MaxTimeMSExpired"})

    with pytest.raises(ExecutionTimeout) as caught:
        bridge.run(slow())
    check_expected_error({"isTimeoutError": True}, caught.value, None)  # type: ignore[arg-type]


def test_run_gives_up_after_its_timeout_but_keeps_the_coroutines_own_timeouts(
    bridge: AsyncBridge,
) -> None:
    with pytest.raises(RunnerError, match="sleep did not finish within 0 s"):
        bridge.run(asyncio.sleep(3600), 0.05)

    async def times_out() -> None:
        await asyncio.sleep(0)
        raise TimeoutError("the coroutine's own")

    with pytest.raises(TimeoutError, match="the coroutine's own"):
        bridge.run(times_out(), 5)


def test_close_cancels_leftover_tasks_and_reports_them() -> None:
    bridge = AsyncBridge()
    bridge.submit(asyncio.sleep(3600))
    started = time.monotonic()
    problems = bridge.close()
    assert time.monotonic() - started < 5
    assert len(problems) == 1 and "still running" in problems[0]
    assert bridge.close() == []  # idempotent
    with pytest.raises(RunnerError, match="closed"):
        bridge.run(asyncio.sleep(0))


# -- the synchronous stream surface -----------------------------------------------------------


class FakeAsyncStream:
    """An AsyncChangeStream stand-in: serves ``events``, then waits (or ends) like a real one."""

    def __init__(self, events: list[Any], *, ends: bool = False) -> None:
        self.events = list(events)
        self.ends = ends
        self.cancelled = False
        self.closed = False

    @property
    def alive(self) -> bool:
        return not self.closed

    @property
    def resume_token(self) -> Any:
        return {"_data": str(len(self.events))}

    async def next(self) -> Any:
        if self.events:
            return self.events.pop(0)
        if self.ends:
            raise StopAsyncIteration
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            self.closed = True
            raise
        raise AssertionError("unreachable")

    async def try_next(self) -> Any:
        return self.events.pop(0) if self.events else None

    async def close(self) -> None:
        self.closed = True


async def _open(stream: FakeAsyncStream) -> FakeAsyncStream:
    return stream


def test_bridged_stream_next_try_next_and_the_end(bridge: AsyncBridge) -> None:
    fake = FakeAsyncStream([{"n": 1}, {"n": 2}], ends=True)
    stream = bridge.open_stream(_open(fake))
    assert stream.resume_token == {"_data": "2"}
    assert stream.next() == {"n": 1}
    assert stream.try_next() == {"n": 2}
    assert stream.try_next() is None
    with pytest.raises(StopIteration):
        stream.next()
    stream.close()
    assert fake.closed and not stream.alive


def test_iteration_limit_cancels_a_waiting_next(bridge: AsyncBridge) -> None:
    fake = FakeAsyncStream([])
    stream = bridge.open_stream(_open(fake))
    started = time.monotonic()
    with pytest.raises(RunnerError, match="no change event within"):
        next_with_limit(stream, 0.2)
    assert time.monotonic() - started < 3
    assert fake.cancelled and fake.closed


def test_bridge_close_closes_open_streams() -> None:
    bridge = AsyncBridge()
    fake = FakeAsyncStream([])
    bridge.open_stream(_open(fake))
    assert bridge.close() == []
    assert fake.closed


# -- client mirrors --------------------------------------------------------------------------------


def test_mirrors_copy_uri_options_listeners_and_namespace_settings(bridge: AsyncBridge) -> None:
    recorder = EventRecorder(["commandStartedEvent"], [])
    options: dict[str, Any] = {
        "appName": "mirrored",
        "retryReads": False,
        "heartbeatFrequencyMS": 600,
        "event_listeners": [recorder],
    }
    client: MongoClient[dict[str, Any]] = MongoClient(UNREACHABLE, connect=False, **options)
    entity = ClientEntity(client, recorder, bridge)
    bridge.register(client, UNREACHABLE, options)
    twin = bridge.mirror(client)
    assert isinstance(twin, AsyncMongoClient)
    assert twin.options.pool_options.metadata["application"] == {"name": "mirrored"}
    assert twin.options.retry_reads is False
    listeners: list[Any] = list(twin.options.event_listeners)
    assert listeners == [recorder]  # the same object: both clients feed one recorder

    db = client.get_database("db", read_concern=ReadConcern("majority"))
    coll = db.get_collection(
        "coll",
        read_preference=ReadPreference.SECONDARY_PREFERRED,
        write_concern=WriteConcern(w=1),
    )
    async_coll = bridge.mirror(coll)
    assert async_coll.full_name == "db.coll"
    assert async_coll.database.client is twin
    assert async_coll.read_preference == ReadPreference.SECONDARY_PREFERRED
    assert async_coll.read_concern == ReadConcern("majority")
    assert async_coll.write_concern == WriteConcern(w=1)
    assert async_coll.codec_options == coll.codec_options

    entity.close()
    with pytest.raises(RunnerError, match="closed"):
        bridge.mirror(client)


def test_unregistered_clients_and_other_targets_are_refused(bridge: AsyncBridge) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(UNREACHABLE, connect=False)
    try:
        with pytest.raises(RunnerError, match="no async mirror"):
            bridge.mirror(client["db"]["coll"])
        with pytest.raises(RunnerError, match="cannot mirror a str"):
            bridge.mirror("db.coll")
        bridge.register(client, UNREACHABLE, {})
        with pytest.raises(RunnerError, match="already has an async mirror"):
            bridge.register(client, UNREACHABLE, {})
    finally:
        client.close()


# -- the adapter, ids and the pytest selection -----------------------------------------------------


def test_async_mode_needs_a_bridge_and_unknown_clients_are_refused() -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(UNREACHABLE, connect=False)
    try:
        with pytest.raises(RunnerError, match="needs the test's AsyncBridge"):
            open_change_stream(client["db"]["coll"], {}, ASYNC_CLIENT)
        with pytest.raises(RunnerError, match="unknown change-stream client 'motor'"):
            open_change_stream(client["db"]["coll"], {}, "motor")
    finally:
        client.close()
    assert [needs_bridge(c) for c in CLIENTS] == [False, True, False]
    with pytest.raises(RunnerError, match="unknown"):
        needs_bridge("motor")


def test_ids_show_the_client_mode() -> None:
    case = Case("change-streams.json", "Test array truncation", "8.0", "replicaset")
    assert case.id_for("changestream") == case.id
    assert case.id == "change-streams.json::Test array truncation[8.0-replicaset]"
    assert case.id_for(ASYNC_CLIENT).endswith("[8.0-replicaset-async]")
    assert case.name_for("pymongo") == "Test array truncation[8.0-replicaset-pymongo]"
    assert len({id_suffix(c) for c in CLIENTS}) == len(CLIENTS)


class _Config:
    def __init__(self, spec_client: str | None) -> None:
        self.spec_client = spec_client

    def getoption(self, name: str, default: Any = None) -> Any:
        return self.spec_client if name == "--spec-client" else default


def test_default_run_covers_both_of_our_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPEC_TESTS_CLIENT", raising=False)
    assert client_impls(_Config(None)) == DEFAULT_CLIENTS == ("changestream", ASYNC_CLIENT)  # type: ignore[arg-type]
    assert client_impls(_Config(ASYNC_CLIENT)) == (ASYNC_CLIENT,)  # type: ignore[arg-type]
    monkeypatch.setenv("SPEC_TESTS_CLIENT", "pymongo")
    assert client_impls(_Config(None)) == ("pymongo",)  # type: ignore[arg-type]
    assert client_impls(_Config(ASYNC_CLIENT)) == (ASYNC_CLIENT,)  # type: ignore[arg-type]


def test_the_default_matrix_runs_sync_everywhere_and_async_on_four_versions_then_slow() -> None:
    """The default suite keeps every version (sync) and every topology (async on
    ASYNC_DEFAULT_VERSIONS); the async cases on the other versions go to ``-m slow``, and a
    matrix narrowed by ``--spec-client`` or ``--spec-versions`` is never cut."""
    from changestream.testing import VERSIONS

    assert set(VERSIONS) >= ASYNC_DEFAULT_VERSIONS and max(VERSIONS, key=_key) in ASYNC_DEFAULT_VERSIONS
    for version in VERSIONS:
        case = Case("change-streams.json", "Test array truncation", version, "sharded")
        assert not is_slow(case, "changestream", True)
        assert is_slow(case, ASYNC_CLIENT, True) == (version not in ASYNC_DEFAULT_VERSIONS)
        assert not any(is_slow(case, client, False) for client in CLIENTS)


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_bridged_streams_are_saved_as_change_stream_entities(bridge: AsyncBridge) -> None:
    stream = bridge.open_stream(_open(FakeAsyncStream([])))
    assert isinstance(stream, BridgedStream)
    entities = EntityMap(None)  # type: ignore[arg-type]  # save_result needs no target
    entities.save_result("changeStream0", stream)
    assert entities.kind_of("changeStream0") == "changeStream"
