"""``on_stats`` comes on its interval also while a poll waits (an outage), on both twins."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

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
