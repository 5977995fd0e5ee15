"""``changestream.aio.consume``: the async at-least-once loop (policy shared with the sync one)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bson
import pytest
from support import Ctx

import changestream
from changestream.aio import AsyncChangeStream, consume, watch
from changestream.stores import AsyncMongoTokenStore, FileTokenStore, MemoryTokenStore

FAST = {"max_await_time_ms": 50}
Run = Callable[..., None]


def same(a: Any, b: Any) -> bool:
    return bson.encode(a) == bson.encode(b)


class Opener:
    """``open_stream`` that records the tokens it was given.

    :meth:`ready` waits until a stream is open (its initial aggregate ran), so
    what a test writes next is after the stream's start: a fixed sleep instead
    loses the race on a loaded machine (the events, or an invalidate, land
    before the stream exists and the test waits for them in vain).
    """

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.tokens: list[Any] = []
        self.opened = asyncio.Event()

    async def __call__(self, token: Any) -> AsyncChangeStream[Any]:
        self.tokens.append(token)
        stream = await watch(self.ctx.coll, resume_after=token, **FAST)
        self.opened.set()
        return stream

    async def ready(self) -> None:
        await asyncio.wait_for(self.opened.wait(), 60)


def test_async_handler_and_async_store(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        store = AsyncMongoTokenStore(ctx.client[ctx.coll.database.name].tokens, "consumer")
        stop = asyncio.Event()
        seen: list[int] = []

        async def handler(change: Any) -> None:
            await asyncio.sleep(0)
            seen.append(change["fullDocument"]["i"])
            if len(seen) == 3:
                stop.set()

        opener = Opener(ctx)
        task = asyncio.create_task(consume(opener, handler, store, stop=stop))
        await opener.ready()
        ctx.writer.insert_many([{"i": i} for i in range(3)])
        result = await asyncio.wait_for(task, 60)
        assert seen == [0, 1, 2] and result.handled == 3
        stored = await store.load()
        assert stored is not None and same(stored.token, result.token)

    run(scenario)


def test_sync_file_store_and_restart_without_loss(run: Run, tmp_path: Path) -> None:
    async def scenario(ctx: Ctx) -> None:
        store = FileTokenStore(tmp_path / "token.json")

        async def consume_until(count: int, opener: Opener) -> list[int]:
            stop = asyncio.Event()
            seen: list[int] = []

            def handler(change: Any) -> None:
                seen.append(change["fullDocument"]["i"])
                if len(seen) == count:
                    stop.set()

            await asyncio.wait_for(consume(opener, handler, store, stop=stop), 30)
            return seen

        opener = Opener(ctx)
        first = asyncio.create_task(consume_until(2, opener))
        await opener.ready()
        ctx.writer.insert_many([{"i": 0}, {"i": 1}])
        assert await first == [0, 1]
        ctx.writer.insert_many([{"i": 2}, {"i": 3}])  # written while nobody consumes
        assert await consume_until(2, Opener(ctx)) == [2, 3]

    run(scenario)


def test_reopens_with_backoff_when_the_single_resume_fails(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="changestream.consume")

    async def scenario(ctx: Ctx) -> None:
        opener = Opener(ctx)
        stop = asyncio.Event()
        seen: list[int] = []

        def handler(change: Any) -> None:
            seen.append(change["fullDocument"]["i"])
            if len(seen) == 2:
                stop.set()

        task = asyncio.create_task(consume(opener, handler, MemoryTokenStore(), stop=stop,
                                           backoff_initial=0.2, backoff_max=1.0))
        await opener.ready()
        ctx.writer.insert_one({"i": 0})
        while not seen:
            await asyncio.sleep(0.01)
        ctx.fail_point("failCommand", {"times": 5}, failCommands=["getMore", "aggregate"],
                       closeConnection=True)
        while len(opener.tokens) < 3:
            await asyncio.sleep(0.01)
        ctx.writer.insert_one({"i": 1})
        result = await asyncio.wait_for(task, 60)
        assert seen == [0, 1] and result.reopens == 2

    run(scenario)
    waits = [r for r in caplog.records if "reopening from the last handled token in" in
             r.getMessage()]
    assert len(waits) == 1


def test_invalidate_and_history_lost_stop_at_once(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        opener = Opener(ctx)
        store = MemoryTokenStore()
        task = asyncio.create_task(consume(opener, lambda change: None, store))
        await opener.ready()
        ctx.writer.insert_one({"i": 0})
        ctx.writer.drop()
        with pytest.raises(changestream.StreamInvalidatedError) as info:
            await asyncio.wait_for(task, 60)
        assert info.value.invalidate_token is not None and len(opener.tokens) == 1

        ctx.fail_point("failCommand", {"times": 1}, failCommands=["aggregate"], errorCode=286)
        again = Opener(ctx)
        with pytest.raises(changestream.HistoryLostError, match="history lost"):
            await asyncio.wait_for(consume(again, lambda change: None, store), 60)
        assert len(again.tokens) == 1

    run(scenario)


def test_cancellation_stores_the_last_handled_token(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        store = MemoryTokenStore()
        handled: list[Any] = []
        opener = Opener(ctx)
        task = asyncio.create_task(
            consume(opener, lambda change: handled.append(change["_id"]), store,
                    save_every=100)
        )
        await opener.ready()
        ctx.writer.insert_many([{"i": 0}, {"i": 1}])
        deadline = asyncio.get_running_loop().time() + 60
        while len(handled) < 2:
            # A consume that ended says why, instead of this loop waiting out pytest's timeout.
            assert not task.done(), f"consume ended: {task.exception()!r}"
            assert asyncio.get_running_loop().time() < deadline, f"handled only {handled}"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stored = store.load()
        assert stored is not None
        # The flush on the way out stored a token at or after the second change.
        time_of = changestream.token_cluster_time
        assert time_of(stored.token) >= time_of(handled[1])  # type: ignore[operator]

    run(scenario)
