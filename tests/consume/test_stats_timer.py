"""``on_stats`` comes on its interval also while a poll waits (an outage), on both twins."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient

import changestream
import changestream.aio
from changestream.stores import MemoryTokenStore

BLOCK_MS = 3000
INTERVAL = 0.3


def block_getmores(uri: str) -> None:
    admin: MongoClient[dict[str, Any]] = MongoClient(uri)
    admin.admin.command("configureFailPoint", "failCommand", mode={"times": 1},
                        data={"failCommands": ["getMore"], "blockConnection": True,
                              "blockTimeMS": BLOCK_MS})
    admin.close()


def reports_while_blocked(reports: list[tuple[float, Any]], since: float) -> list[Any]:
    return [s for at, s in reports if since + 0.5 <= at <= since + BLOCK_MS / 1000 - 0.5]


def test_sync_consume_reports_while_a_poll_is_blocked(simulator: Any) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    coll = client.db.c
    coll.insert_one({"setup": True})
    reports: list[tuple[float, Any]] = []
    stop = threading.Event()
    consumer = threading.Thread(
        target=changestream.consume,
        args=(lambda token: changestream.watch(coll, resume_after=token), lambda c: None,
              MemoryTokenStore()),
        kwargs={"stop": stop, "on_stats": lambda s: reports.append((time.monotonic(), s)),
                "stats_interval": INTERVAL},
    )
    consumer.start()
    time.sleep(1)
    blocked_at = time.monotonic()
    block_getmores(simulator.uri)
    time.sleep(BLOCK_MS / 1000 + 0.5)
    stop.set()
    consumer.join(30)
    client.close()
    during = reports_while_blocked(reports, blocked_at)
    assert len(during) >= 4, f"{len(during)} reports while the getMore was blocked"
    assert reports[-1][1].final
    assert sum(s.final for _, s in reports) == 1  # nothing after the final report


def test_async_consume_reports_while_a_poll_is_blocked(simulator: Any) -> None:
    reports: list[tuple[float, Any]] = []

    async def main() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(simulator.uri)
        coll = client.db.c
        await coll.insert_one({"setup": True})
        stop = asyncio.Event()
        task = asyncio.create_task(changestream.aio.consume(
            lambda token: changestream.aio.watch(coll, resume_after=token), lambda c: None,
            MemoryTokenStore(), stop=stop,
            on_stats=lambda s: reports.append((time.monotonic(), s)), stats_interval=INTERVAL,
        ))
        await asyncio.sleep(1)
        blocked_at = time.monotonic()
        await asyncio.to_thread(block_getmores, simulator.uri)
        await asyncio.sleep(BLOCK_MS / 1000 + 0.5)
        stop.set()
        await asyncio.wait_for(task, 30)
        await client.close()
        during = reports_while_blocked(reports, blocked_at)
        assert len(during) >= 4, f"{len(during)} reports while the getMore was blocked"

    asyncio.run(main())
    assert reports[-1][1].final


# -- the timer's life: also without on_stats, never past consume (issue 32) ---------------------------
def stats_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "changestream-stats" and t.is_alive()}


def timer_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "_tick"]


@pytest.mark.parametrize("on_stats", [None, lambda stats: None], ids=["no_on_stats", "on_stats"])
@pytest.mark.parametrize("ending", ["returns", "raises"])
def test_sync_consume_leaves_no_timer_thread(simulator: Any, on_stats: Any, ending: str) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    coll = client.db.c
    before = stats_threads()
    during: list[set[threading.Thread]] = []
    stop = threading.Event()

    def handle(change: Any) -> None:
        during.append(stats_threads() - before)
        if ending == "raises":
            raise RuntimeError("handler failed")
        stop.set()

    coll.insert_one({"setup": True})
    store = MemoryTokenStore()
    with changestream.watch(coll) as stream:
        store.save(stream.resume_token)
    coll.insert_one({"i": 1})
    try:
        changestream.consume(coll, handle, store, stop=stop, on_stats=on_stats,
                             stats_interval=0.05)
    except RuntimeError:
        assert ending == "raises"
    finally:
        client.close()
    assert len(during) == 1 and len(during[0]) == 1  # the timer ran, also without on_stats
    assert not stats_threads() - before  # and ended with consume


@pytest.mark.parametrize("on_stats", [None, lambda stats: None], ids=["no_on_stats", "on_stats"])
@pytest.mark.parametrize("ending", ["returns", "raises"])
def test_async_consume_leaves_no_timer_task(simulator: Any, on_stats: Any, ending: str) -> None:
    async def main() -> tuple[int, int]:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(simulator.uri)
        coll = client.db.c
        during: list[int] = []
        stop = asyncio.Event()

        async def handle(change: Any) -> None:
            during.append(len(timer_tasks()))
            if ending == "raises":
                raise RuntimeError("handler failed")
            stop.set()

        await coll.insert_one({"setup": True})
        store = MemoryTokenStore()
        async with await changestream.aio.watch(coll) as stream:
            store.save(stream.resume_token)
        await coll.insert_one({"i": 1})
        try:
            await changestream.aio.consume(coll, handle, store, stop=stop, on_stats=on_stats,
                                           stats_interval=0.05)
        except RuntimeError:
            assert ending == "raises"
        finally:
            await client.close()
        return during[0], len(timer_tasks())

    during, after = asyncio.run(main())
    assert during == 1  # the timer ran, also without on_stats
    assert after == 0  # and ended with consume


def test_server_probes_false_starts_no_timer_without_on_stats(simulator: Any) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    coll = client.db.c
    before = stats_threads()
    during: list[set[threading.Thread]] = []
    stop = threading.Event()

    def handle(change: Any) -> None:
        during.append(stats_threads() - before)
        stop.set()

    store = MemoryTokenStore()
    with changestream.watch(coll) as stream:
        store.save(stream.resume_token)
    coll.insert_one({"i": 1})
    try:
        changestream.consume(coll, handle, store, stop=stop, server_probes=False)
        with pytest.raises(ValueError, match="server_probes must be True or False, not 'no'"):
            changestream.consume(coll, handle, store, server_probes="no")  # type: ignore[arg-type]
    finally:
        client.close()
    assert during == [set()]


class ShardedStream:
    """A stream through mongos: the oplog is not readable there."""

    client = type("C", (), {"topology_description": type(
        "D", (), {"topology_type_name": "Sharded"})()})()
    resumes = 0
    position = None


def test_where_the_oplog_is_unreadable_the_timer_says_so_once_and_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No callback and no oplog to read (mongos, no privilege): one INFO line, and the timer
    thread ends at once instead of waking every second for nothing."""
    from changestream._metrics import StatsReporter
    from changestream._sync._stats_timer import _tick

    stats = StatsReporter(None, 0.05)
    stats.on_stream(ShardedStream())
    run = type("R", (), {"stats": stats, "opened": 1,
                         "progress": type("P", (), {"handled": 0})()})()
    with caplog.at_level(logging.INFO, logger="changestream"):
        timer = threading.Thread(target=_tick, args=(run, stats), daemon=True)
        timer.start()
        timer.join(5)
    assert not timer.is_alive()
    lines = [r for r in caplog.records if "not readable through mongos" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert not stats.wanted
    with_callback = StatsReporter(lambda stats: None, 0.05)
    with_callback.headroom.give_up("unreadable")
    assert with_callback.wanted  # the reports still come
