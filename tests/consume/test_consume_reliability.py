"""``consume`` / ``aio.consume`` under a sick server: no hot loop, no silent hang, clean stops."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient, monitoring
from pymongo.errors import OperationFailure, ServerSelectionTimeoutError

import changestream
import changestream.aio
from changestream._machine import MAX_IDLE_RESUMES
from changestream.stores import MemoryTokenStore

FAST = {"max_await_time_ms": 50}


class AggregateCounter(monitoring.CommandListener):
    def __init__(self) -> None:
        self.aggregates: list[float] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "aggregate":
            self.aggregates.append(time.monotonic())

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass



@pytest.fixture
def names(mongodb_uri: str) -> Iterator[tuple[str, str]]:
    database = f"cs_rel_{uuid.uuid4().hex[:8]}"
    with MongoClient(mongodb_uri) as admin:
        admin[database].create_collection("coll")
        yield database, "coll"
        admin.drop_database(database)


SICK_GETMORES = [
    pytest.param({"errorCode": 43}, "43 CursorNotFound", id="CursorNotFound"),
    pytest.param({"errorCode": 91, "errorLabels": ["ResumableChangeStreamError"]},
                 "91 ShutdownInProgress", id="labelled-ShutdownInProgress"),
]


@pytest.mark.parametrize(("error", "named"), SICK_GETMORES)
def test_a_server_failing_every_get_more_is_not_hammered_and_retry_for_holds(
    mongodb_uri: str, names: tuple[str, str], fail_point: Callable[..., None],
    error: dict[str, Any], named: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="changestream.consume")
    counter = AggregateCounter()
    fail_point("alwaysOn", failCommands=["getMore"], **error)
    # A shutdown error without topologyVersion (mongod adds it only in quiesce mode) makes PyMongo
    # mark the primary Unknown, so each resume waits for the monitor's next check: a short
    # heartbeat keeps this test about consume's retry loop, not about PyMongo's SDAM.
    with MongoClient(mongodb_uri, event_listeners=[counter], heartbeatFrequencyMS=500) as client:
        coll = client[names[0]][names[1]]
        started = time.monotonic()
        with pytest.raises(changestream.RetriesExhaustedError) as info:
            changestream.consume(
                lambda token: changestream.watch(coll, resume_after=token, **FAST),
                lambda change: None, MemoryTokenStore(), retry_for=3.0,
            )
        elapsed = time.monotonic() - started
    assert 3.0 <= elapsed < 15, "retry_for is honoured"
    # Each reopen costs at most 1 + MAX_IDLE_RESUMES aggregates, and reopens back off
    # (0.5 s, 1 s, 2 s, ...): a few per second, where the old loop ran ~850 per second.
    aggregates = len(counter.aggregates)
    assert aggregates <= 6 * (1 + MAX_IDLE_RESUMES), counter.aggregates
    assert aggregates / elapsed < 8
    assert named in str(info.value), "the error names the repeated failure"
    assert "full error" not in str(info.value) and "$clusterTime" not in str(info.value)
    assert any("reopening from the last handled token in" in r.getMessage()
               for r in caplog.records), "each retry is logged"


def test_async_consume_is_not_hammering_either(
    mongodb_uri: str, names: tuple[str, str], fail_point: Callable[..., None]
) -> None:
    counter = AggregateCounter()
    fail_point("alwaysOn", failCommands=["getMore"], errorCode=43)

    async def run() -> BaseException:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            mongodb_uri, event_listeners=[counter]
        )
        coll = client[names[0]][names[1]]

        async def open_stream(token: Any) -> changestream.aio.AsyncChangeStream[Any]:
            return await changestream.aio.watch(coll, resume_after=token, **FAST)

        try:
            await changestream.aio.consume(open_stream, lambda change: None, MemoryTokenStore(),
                                           retry_for=2.0)
        except changestream.RetriesExhaustedError as exc:
            return exc
        finally:
            await client.close()
        raise AssertionError("consume returned")

    started = time.monotonic()
    error = asyncio.run(run())
    elapsed = time.monotonic() - started
    assert 2.0 <= elapsed < 15
    assert len(counter.aggregates) / elapsed < 8
    assert "43 CursorNotFound" in str(error)


def test_a_server_that_stops_answering_becomes_a_retry_with_a_warning(
    mongodb_uri: str, names: tuple[str, str], fail_point: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="changestream.consume")
    handled: list[Any] = []
    stop = threading.Event()
    with MongoClient(mongodb_uri) as client:
        coll = client[names[0]][names[1]]
        # Two getMores hang for 4 s each; the per-call timeout is 1 s.
        fail_point({"times": 2}, failCommands=["getMore"], blockConnection=True,
                   blockTimeMS=4000)

        def handle(change: Any) -> None:
            handled.append(change)
            stop.set()

        def insert_later() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                "NetworkTimeout" in r.getMessage() or "timed out" in r.getMessage()
                for r in caplog.records
            ):
                time.sleep(0.05)
            coll.insert_one({"after": "the hang"})

        threading.Thread(target=insert_later, daemon=True).start()
        started = time.monotonic()
        result = changestream.consume(
            lambda token: changestream.watch(coll, resume_after=token, **FAST),
            handle, MemoryTokenStore(), call_timeout=1.0, backoff_initial=0.1, stop=stop,
        )
        assert time.monotonic() - started < 30
    assert result.handled == 1 and handled[0]["fullDocument"]["after"] == "the hang"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("timed out" in w or "Timeout" in w for w in warnings), warnings


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), 1e9, "5", True])
def test_call_timeout_is_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match="call_timeout"):
        changestream.consume(lambda token: None, lambda change: None,  # type: ignore[arg-type,return-value]
                             MemoryTokenStore(), call_timeout=bad)


def test_stop_on_signals_needs_the_main_thread() -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            changestream.consume(lambda token: None, lambda change: None,  # type: ignore[arg-type,return-value]
                                 MemoryTokenStore(), stop_on_signals=True)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert len(errors) == 1 and "main thread" in str(errors[0])


CONSUMER = textwrap.dedent("""
    import sys
    from pymongo import MongoClient
    import changestream
    from changestream.stores import FileTokenStore

    client = MongoClient(sys.argv[1])
    coll = client[sys.argv[2]][sys.argv[3]]

    def handle(change):
        print("handled", change["fullDocument"]["i"], flush=True)

    result = changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token, max_await_time_ms=50),
        handle, FileTokenStore(sys.argv[4]), stop_on_signals=True{async_flag},
    )
    print("stopped cleanly after", result.handled, flush=True)
""")


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_stop_on_signals_stops_cleanly_on_sigterm(
    mongodb_uri: str, names: tuple[str, str], tmp_path: Any, flavour: str
) -> None:
    script = CONSUMER.format(async_flag="")
    if flavour == "async":
        script = textwrap.dedent("""
            import asyncio, sys
            from pymongo import AsyncMongoClient
            import changestream.aio
            from changestream.stores import FileTokenStore

            async def main():
                client = AsyncMongoClient(sys.argv[1])
                coll = client[sys.argv[2]][sys.argv[3]]

                async def open_stream(token):
                    return await changestream.aio.watch(coll, resume_after=token,
                                                        max_await_time_ms=50)

                def handle(change):
                    print("handled", change["fullDocument"]["i"], flush=True)

                result = await changestream.aio.consume(
                    open_stream, handle, FileTokenStore(sys.argv[4]), stop_on_signals=True)
                print("stopped cleanly after", result.handled, flush=True)
                await client.close()

            asyncio.run(main())
        """)
    token_file = tmp_path / "token.json"
    process = subprocess.Popen(
        [sys.executable, "-c", script, mongodb_uri, *names, str(token_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    try:
        with MongoClient(mongodb_uri) as writer:
            deadline = time.monotonic() + 60
            while not token_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # the first save happens once the stream is open
            writer[names[0]][names[1]].insert_one({"i": 1})
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "handled 1"
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "stopped cleanly after 1" in out
    assert "Traceback" not in err
    assert "received SIGTERM" in err


def test_a_server_error_that_ends_consume_reads_code_name_and_message(
    mongodb_uri: str, names: tuple[str, str], fail_point: Callable[..., None]
) -> None:
    fail_point({"times": 1}, failCommands=["aggregate"], errorCode=2)
    with MongoClient(mongodb_uri) as client:
        coll = client[names[0]][names[1]]
        with pytest.raises(OperationFailure) as info:
            changestream.consume(
                lambda token: changestream.watch(coll, resume_after=token, **FAST),
                lambda change: None, MemoryTokenStore(),
            )
    assert str(info.value).startswith("2 BadValue:")
    assert "full error" not in str(info.value)
    assert info.value.code == 2 and info.value.details is not None  # the rest is kept


def test_describe_error_and_one_line() -> None:
    details = {"ok": 0, "errmsg": "cursor id 7 not found", "code": 43,
               "codeName": "CursorNotFound", "$clusterTime": {"signature": {"hash": b"x" * 20}}}
    error = OperationFailure("cursor id 7 not found", 43, details)
    assert "full error" in str(error)
    assert changestream.describe_error(error) == "43 CursorNotFound: cursor id 7 not found"
    clean = changestream.one_line(error)
    assert type(clean) is OperationFailure and str(clean) == "43 CursorNotFound: cursor id 7 not found"
    assert clean.details == details and clean.code == 43
    timeout = ServerSelectionTimeoutError(
        "127.0.0.1:1: [Errno 111] Connection refused (configured timeouts: socketTimeoutMS: "
        "20000.0ms), Timeout: 30s, Topology Description: <TopologyDescription ...>"
    )
    assert changestream.describe_error(timeout) == (
        "ServerSelectionTimeoutError: 127.0.0.1:1: [Errno 111] Connection refused"
    )
    plain = ValueError("x")
    assert changestream.one_line(plain) is plain


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_retry_for_bounds_the_wait_to_select_a_server(mode: str) -> None:
    """PyMongo waits 30 s (serverSelectionTimeoutMS) for a server by default; each open is
    cut to what is left of ``retry_for``, so ``retry_for=1.5`` gives up in seconds."""
    uri = f"mongodb://127.0.0.1:{_closed_port()}/?directConnection=true"
    started = time.monotonic()
    with pytest.raises(changestream.RetriesExhaustedError, match=r"kept failing for 1\.5 s"):
        if mode == "sync":
            coll = MongoClient(uri)["db"]["c"]
            changestream.consume(lambda token: changestream.watch(coll, resume_after=token),
                                 lambda change: None, MemoryTokenStore(), retry_for=1.5)
        else:
            async def run() -> None:
                client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
                coll = client["db"]["c"]
                try:
                    await changestream.aio.consume(
                        lambda token: changestream.aio.watch(coll, resume_after=token),
                        lambda change: None, MemoryTokenStore(), retry_for=1.5)
                finally:
                    await client.close()

            asyncio.run(run())
    assert time.monotonic() - started < 10  # was 30-60 s: one server selection per attempt
