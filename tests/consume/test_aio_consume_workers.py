"""``changestream.aio.consume(workers=N)``, ``on_error`` and ``on_history_lost`` (the async twin).

The same promises as ``test_consume_workers.py``, with handler tasks:
per-key order, a barrier running alone, the low watermark never passing an
unhandled change, a poison change stopping the run or dead-lettered, the
lost history recovered from now with an async ``gap`` function.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import bson
import pytest
from pymongo import AsyncMongoClient, MongoClient
from support import Ctx

import changestream
from changestream.aio import consume, watch
from changestream.stores import FileTokenStore, MemoryTokenStore, StoredToken

FAST = {"max_await_time_ms": 50}
Run = Callable[..., None]


async def start_token(coll: Any) -> Any:
    stream = await watch(coll, **FAST)
    try:
        return stream.resume_token
    finally:
        await stream.close()


def stored_at(token: Any) -> MemoryTokenStore:
    return MemoryTokenStore(StoredToken(token, None, changestream.stores._now()))


async def tokens_in_order(coll: Any, start: Any, count: int) -> list[bytes]:
    """The BSON of the first ``count`` change tokens after ``start``, in stream order."""
    order: list[bytes] = []
    stream = await watch(coll, resume_after=start, **FAST)
    while len(order) < count:
        change = await stream.try_next()
        if change is not None:
            order.append(bson.encode(change["_id"]))
    await stream.close()
    return order


class CheckingStore(MemoryTokenStore):
    """Fails the test if a saved token has an unhandled change at or before it."""

    def __init__(self, order: list[bytes], finished: set[bytes]) -> None:
        super().__init__(None)
        self.order = order
        self.finished = finished
        self.violations: list[str] = []

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        encoded = bson.encode(token)
        if encoded in self.order:
            position = self.order.index(encoded)
            missing = [p for p in range(position + 1) if self.order[p] not in self.finished]
            if missing:
                self.violations.append(f"saved {position} with {missing[:3]} unhandled")
        super().save(token, batch_id=batch_id)


def test_tasks_keep_per_key_order_and_the_watermark(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        start = await start_token(ctx.coll)
        documents, updates = 20, 10
        ctx.writer.insert_many([{"_id": i, "v": 0} for i in range(documents)])
        for version in range(1, updates + 1):
            for i in range(documents):
                ctx.writer.update_one({"_id": i}, {"$set": {"v": version}})
        total = documents * (updates + 1)
        order = await tokens_in_order(ctx.coll, start, total)
        finished: set[bytes] = set()
        store = CheckingStore(order, finished)
        store.save(start)
        rng = random.Random(5)
        running: set[Any] = set()
        problems: list[str] = []
        versions: dict[Any, list[int]] = {}
        stop = asyncio.Event()
        overlap = 0

        async def handle(change: Any) -> None:
            nonlocal overlap
            key = change["documentKey"]["_id"]
            if key in running:
                problems.append(f"{key} ran twice at once")
            running.add(key)
            overlap = max(overlap, len(running))
            fields = change.get("updateDescription", {}).get("updatedFields", {"v": 0})
            versions.setdefault(key, []).append(fields["v"])
            await asyncio.sleep(rng.random() * 0.003)
            running.discard(key)
            finished.add(bson.encode(change["_id"]))
            if len(finished) == total:
                stop.set()

        result = await consume(
            lambda token: watch(ctx.coll, resume_after=token, **FAST), handle, store,
            stop=stop, workers=100,
        )
        assert not problems and not store.violations, (problems[:3], store.violations[:3])
        assert result.handled == total and overlap > 1
        assert all(v == list(range(updates + 1)) for v in versions.values()), versions

    run(scenario)


def test_a_drop_runs_alone_and_the_invalidate_token_is_after_everything(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        start = await start_token(ctx.coll)
        ctx.writer.insert_many([{"_id": i} for i in range(30)])
        ctx.writer.drop()
        running: list[str] = []
        problems: list[str] = []
        seen: list[Any] = []

        async def handle(change: Any) -> None:
            kind = change["operationType"]
            if running and (kind == "drop" or "drop" in running):
                problems.append(f"{kind} ran beside {running}")
            running.append(kind)
            await asyncio.sleep(0.001)
            running.remove(kind)
            seen.append(change)

        store = stored_at(start)
        with pytest.raises(changestream.StreamInvalidatedError) as info:
            await consume(lambda token: watch(ctx.coll, resume_after=token, **FAST), handle,
                          store, workers=16)
        assert not problems, problems
        assert seen[-1]["operationType"] == "drop" and len(seen) == 31
        assert bson.encode(info.value.token) == bson.encode(seen[-1]["_id"])
        assert type(info.value.token) is dict and type(info.value.invalidate_token) is dict

    run(scenario)


def test_a_poison_change_with_tasks_is_retried_then_dead_lettered(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        start = await start_token(ctx.coll)
        ctx.writer.insert_many([{"_id": i} for i in range(10)])
        letters: list[int] = []
        handled: list[int] = []
        stop = asyncio.Event()
        attempts = 0

        async def handle(change: Any) -> None:
            nonlocal attempts
            if change["documentKey"]["_id"] == 4:
                attempts += 1
                raise RuntimeError("poison")
            handled.append(change["documentKey"]["_id"])

        async def dead_letter(change: Any, exc: BaseException) -> None:
            letters.append(change["documentKey"]["_id"])

        def report(stats: changestream.ConsumeStats) -> None:
            if stats.handled == 10:
                stop.set()

        stats: list[changestream.ConsumeStats] = []
        await consume(
            lambda token: watch(ctx.coll, resume_after=token, **FAST), handle, stored_at(start),
            stop=stop, workers=4, stats_interval=0.01,
            on_stats=lambda s: (stats.append(s), report(s)),
            on_error=changestream.OnError(retries=2, backoff_initial=0,
                                          dead_letter=dead_letter))
        assert letters == [4] and attempts == 3
        assert sorted(handled) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
        assert stats[-1].dead_letters == 1 and stats[-1].retries == 2

        # Without dead_letter, the run stops with the handler's error and the token before it.
        store = stored_at(start)
        with pytest.raises(RuntimeError, match="poison"):
            await consume(lambda token: watch(ctx.coll, resume_after=token, **FAST), handle,
                          store, workers=4, on_error=changestream.OnError(retries=0))
        stream = await watch(ctx.coll, resume_after=store.load().token, **FAST)  # type: ignore[union-attr]
        first = None
        while first is None:
            first = await stream.try_next()
        await stream.close()
        assert first["documentKey"]["_id"] == 4

    run(scenario)


def test_history_lost_from_now_calls_an_async_gap(tmp_path: Path) -> None:
    if os.environ.get("MONGODB_URI"):
        pytest.skip("needs the simulator's small oplog (MONGODB_URI points at a real deployment)")
    from changestream.testing import ReplicaSet

    with ReplicaSet("8.0", oplog_max_entries=20) as rs, MongoClient(rs.uri) as writer:
        store = FileTokenStore(tmp_path / "token.json")
        with changestream.watch(writer.db.orders, **FAST) as stream:
            store.save(stream.resume_token)
        writer.db.orders.insert_many([{"i": i} for i in range(50)])
        gaps: list[changestream.HistoryGap] = []
        seen: list[int] = []

        async def main() -> None:
            client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(rs.uri)
            coll = client.db.orders
            stop = asyncio.Event()
            opened = asyncio.Event()

            async def open_stream(token: Any) -> Any:
                stream = await watch(coll, resume_after=token, **FAST)
                if token is None:
                    opened.set()
                return stream

            async def gap(lost: changestream.HistoryGap) -> None:
                gaps.append(lost)

            async def handle(change: Any) -> None:
                seen.append(change["fullDocument"]["i"])
                stop.set()

            async def write_later() -> None:
                await opened.wait()
                await asyncio.to_thread(writer.db.orders.insert_one, {"i": 100})

            writing = asyncio.create_task(write_later())
            try:
                await consume(open_stream, handle, store, stop=stop, workers=8,
                              on_history_lost="from_now", gap=gap)
            finally:
                await writing
                await client.close()

        asyncio.run(main())
    assert seen == [100] and [g.action for g in gaps] == ["from_now"]


def test_cancelling_the_task_lets_admitted_changes_finish_then_stores_the_watermark(
        run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        start = await start_token(ctx.coll)
        ctx.writer.insert_many([{"_id": i} for i in range(20)])
        handled: list[int] = []
        first = asyncio.Event()

        async def handle(change: Any) -> None:
            first.set()
            await asyncio.sleep(0.05)
            handled.append(change["documentKey"]["_id"])

        store = stored_at(start)
        task = asyncio.create_task(consume(
            lambda token: watch(ctx.coll, resume_after=token, **FAST), handle, store,
            workers=4, max_in_flight=8))
        await asyncio.wait_for(first.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert handled, "the admitted changes finished"
        assert sorted(handled) == list(range(len(handled)))  # a prefix: nothing skipped
        stream = await watch(ctx.coll, resume_after=store.load().token, **FAST)  # type: ignore[union-attr]
        nxt = None
        while nxt is None:
            nxt = await stream.try_next()
        await stream.close()
        assert nxt["documentKey"]["_id"] == len(handled)  # resumes right after them

    run(scenario)


def test_a_crash_redelivers_at_most_max_in_flight_even_while_saves_are_slow(run: Run) -> None:
    """The async twin: tasks that end while an async store writes make no extra room."""

    async def scenario(ctx: Ctx) -> None:
        start = await start_token(ctx.coll)
        total, max_in_flight = 400, 8
        ctx.writer.insert_many([{"_id": i} for i in range(total)])
        order = await tokens_in_order(ctx.coll, start, total)
        stored = -1
        widest = 0
        stop = asyncio.Event()

        class SlowStore(MemoryTokenStore):
            async def save(  # type: ignore[override]
                    self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
                nonlocal stored
                await asyncio.sleep(0.005)
                MemoryTokenStore.save(self, token, batch_id=batch_id)
                encoded = bson.encode(token)
                if encoded in order:
                    stored = max(stored, order.index(encoded))

        async def handle(change: Any) -> None:
            nonlocal widest
            widest = max(widest, order.index(bson.encode(change["_id"])) - stored)
            await asyncio.sleep(0.0005)
            if change["documentKey"]["_id"] == total - 1:
                stop.set()

        store = SlowStore(StoredToken(start, None, changestream.stores._now()))
        result = await consume(
            lambda token: watch(ctx.coll, resume_after=token, **FAST), handle, store,
            stop=stop, workers=4, max_in_flight=max_in_flight,
        )
        assert result.handled == total
        assert 1 < widest <= max_in_flight, widest

    run(scenario)


def test_a_stop_after_the_last_change_does_not_wait_for_the_getmore_in_flight(run: Run) -> None:
    # A long await makes the old wait plain: the stop waited for the getMore to come back.
    slow_await = {"max_await_time_ms": 10_000}

    async def scenario(ctx: Ctx) -> None:
        start = await start_token(ctx.coll)
        ctx.writer.insert_many([{"_id": i} for i in range(20)])
        stop = asyncio.Event()
        handled: list[int] = []
        stopped_at: list[float] = []

        async def handle(change: Any) -> None:
            handled.append(change["documentKey"]["_id"])
            if len(handled) == 20:
                await asyncio.sleep(0.2)  # the loop is back in a getMore by now
                stopped_at.append(asyncio.get_running_loop().time())
                stop.set()

        store = stored_at(start)
        await consume(lambda token: watch(ctx.coll, resume_after=token, **slow_await), handle,
                      store, stop=stop, workers=4)
        waited = asyncio.get_running_loop().time() - stopped_at[0]
        assert sorted(handled) == list(range(20))
        assert waited < 5, f"the stop waited {waited:.1f} s for the getMore's await"
        # Nothing lost: the stored token is after the last change, and the stream goes on.
        ctx.writer.insert_one({"_id": 20})
        stream = await watch(ctx.coll, resume_after=store.load().token, **FAST)  # type: ignore[union-attr]
        first = None
        while first is None:
            first = await stream.try_next()
        await stream.close()
        assert first["documentKey"]["_id"] == 20

    run(scenario)


def test_stop_while_waiting_for_room_at_max_in_flight_returns_within_drain_timeout(
    run: Run,
) -> None:
    async def scenario(ctx: Ctx) -> None:
        start = await start_token(ctx.coll)
        ctx.writer.insert_many([{"_id": i} for i in range(40)])
        release = asyncio.Event()
        handled: list[int] = []

        async def handle(change: Any) -> None:
            if change["documentKey"]["_id"] == 0:
                await asyncio.wait_for(release.wait(), 60)  # holds the watermark
            handled.append(change["documentKey"]["_id"])

        stop = asyncio.Event()
        store = stored_at(start)
        task = asyncio.create_task(consume(
            lambda token: watch(ctx.coll, resume_after=token, **FAST), handle, store,
            stop=stop, workers=4, max_in_flight=6, drain_timeout=1))
        while len(handled) < 5:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the loop now waits for room behind change 0
        stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), 10)
        finally:
            release.set()
        assert store.load().token == start  # type: ignore[union-attr]

    run(scenario)
