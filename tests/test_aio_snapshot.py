"""The asyncio twin of snapshot-then-stream: same records, same positions, same consume."""

from __future__ import annotations

import asyncio
from typing import Any

from pymongo import AsyncMongoClient, MongoClient
from snapshot_support import Sink, Writer, collection_state, make_collection

import changestream
from changestream._snapshot import SnapshotPosition
from changestream.stores import MemoryTokenStore

WATCH = {"full_document": "required", "max_await_time_ms": 50}


def test_async_copy_restart_then_stream(simulator: Any) -> None:
    sync: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    coll = make_collection(sync.test, "c", 80)
    writer = Writer(coll, 80)
    sink = Sink()

    async def main() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(simulator.uri)
        acoll = client.test.c
        try:
            stream = await changestream.aio.snapshot_then_watch(acoll, copy_batch_size=6, **WATCH)
            for i in range(30):
                sink.apply(await stream.try_next())
                if i % 5 == 0:
                    await asyncio.to_thread(writer.write, 3)
            position = stream.resume_token
            await stream.close()
            assert SnapshotPosition.parse(position).last_id == 29
            async with await changestream.aio.snapshot_then_watch(
                acoll, resume_after=position, **WATCH
            ) as again:
                while again.copying:
                    record = await again.try_next()
                    if record is None:
                        break
                    sink.apply(record)
                await asyncio.to_thread(writer.write, 10)
                while len(sink.data_events()) < writer.events:
                    change = await again.try_next()
                    if change is not None:
                        sink.apply(change)
        finally:
            await client.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        assert sink.docs == collection_state(coll)
        assert set(sink.copied) == set(range(80)) and max(sink.copied.values()) == 1
        assert len(sink.data_events()) == writer.events
    finally:
        sync.close()


def test_async_consume_initial_snapshot(simulator: Any) -> None:
    sync: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    coll = make_collection(sync.test, "c", 40)
    writer = Writer(coll, 40)
    writer.write(0)
    sink = Sink()
    store = MemoryTokenStore()

    async def main() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(simulator.uri)
        stop = asyncio.Event()
        wrote = False

        async def handler(record: dict[str, Any]) -> None:
            nonlocal wrote
            sink.apply(record)
            if len(sink.copied) == 20 and not wrote:
                wrote = True
                await asyncio.to_thread(writer.write, 12)
            if len(sink.copied) == 40 and len(sink.data_events()) >= writer.events:
                stop.set()

        try:
            await changestream.aio.consume(client.test.c, handler, store, initial_snapshot=True,
                                           stop=stop, watch_options=WATCH)
        finally:
            await client.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        assert sink.docs == collection_state(coll)
        assert max(sink.copied.values()) == 1
        assert len(sink.data_events()) == writer.events
    finally:
        sync.close()


def test_async_copy_runs_inside_a_client_side_timeout(simulator: Any) -> None:
    """The async twin's copy getMores carry no ``maxTimeMS`` under CSOT either."""
    import pymongo

    sync: MongoClient[dict[str, Any]] = MongoClient(simulator.uri)
    make_collection(sync.test, "c", 40)
    copied: list[Any] = []

    async def main() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(simulator.uri)
        try:
            with pymongo.timeout(30):
                async with await changestream.aio.snapshot_then_watch(
                    client.test.c, copy_batch_size=7, **WATCH
                ) as stream:
                    while stream.copying:
                        record = await stream.try_next()
                        if record is None:
                            break
                        copied.append(record["documentKey"]["_id"])
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        sync.close()
    assert sorted(copied) == list(range(40))
