"""The hub: one change stream, many in-process subscribers (sync and asyncio twins)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient, monitoring

import changestream
import changestream.aio
from changestream._match import compile_match


class Aggregates(monitoring.CommandListener):
    """The change-stream commands the server receives from one client."""

    def __init__(self) -> None:
        self.aggregates = 0
        self.cursors: set[int] = set()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "aggregate" and any(
            "$changeStream" in stage for stage in event.command.get("pipeline", [])
        ):
            self.aggregates += 1
        if event.command_name == "getMore":
            self.cursors.add(int(event.command["getMore"]))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def ev(**fields: Any) -> dict[str, Any]:
    return {"operationType": "insert", "ns": {"db": "shop", "coll": "orders"}, **fields}


# -- the client-side $match -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("match", "event", "expected"),
    [
        ({"operationType": "insert"}, ev(), True),
        ({"operationType": {"$in": ["update", "delete"]}}, ev(), False),
        ({"ns.coll": "orders", "fullDocument.total": {"$gt": 100}},
         ev(fullDocument={"total": 150}), True),
        ({"fullDocument.total": {"$gte": 100, "$lt": 200}}, ev(fullDocument={"total": 200}), False),
        ({"fullDocument.total": {"$gt": 100}}, ev(fullDocument={"total": "150"}), False),
        ({"fullDocument.tags": "red"}, ev(fullDocument={"tags": ["blue", "red"]}), True),
        ({"fullDocument.flag": 1}, ev(fullDocument={"flag": True}), False),
        ({"fullDocument": {"$exists": False}}, ev(), True),
        ({"updateDescription.removedFields": {"$exists": True}}, ev(), False),
        ({"$or": [{"operationType": "delete"}, {"ns.coll": "orders"}]}, ev(), True),
        ({"$nor": [{"operationType": "insert"}]}, ev(), False),
        ({"operationType": {"$not": {"$eq": "insert"}}}, ev(), False),
        ({"operationType": {"$ne": "delete"}, "$and": [{"ns.db": "shop"}]}, ev(), True),
        ({"fullDocument.total": None}, ev(), True),
    ],
)
def test_match_evaluates_the_documented_operators_client_side(
    match: dict[str, Any], event: dict[str, Any], expected: bool
) -> None:
    assert compile_match(match)(event) is expected


@pytest.mark.parametrize(
    ("match", "message"),
    [
        ({"fullDocument.name": {"$regex": "^a"}}, r"the operator '\$regex' is not supported"),
        ({"$expr": {"$eq": ["$a", 1]}}, r"the top-level operator '\$expr' is not supported"),
        ({"a": {"$in": 3}}, r"\$in needs a list"),
        ({"a": {"$gt": 1, "b": 2}}, "mixes operators and fields"),
        ({"$or": []}, "needs a non-empty list"),
    ],
)
def test_match_refuses_what_it_does_not_support_with_one_clear_error(
    match: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        compile_match(match)


# -- the sync hub ------------------------------------------------------------------------------
@pytest.fixture
def setup(simulator: Any) -> Iterator[tuple[Any, Aggregates]]:
    listener = Aggregates()
    client: MongoClient[dict[str, Any]] = MongoClient(simulator.uri, event_listeners=[listener])
    client.shop.orders.insert_one({"setup": True})
    yield client.shop.orders, listener
    client.close()


def run_until(hub: Any, changes: int) -> None:
    deadline = time.monotonic() + 30
    while hub.changes < changes and time.monotonic() < deadline:
        time.sleep(0.02)
    hub.stop()
    hub.join(10)


def test_one_cursor_feeds_every_subscriber_its_own_filter_in_order(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, listener = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        subscribers = [hub.subscribe(match={"fullDocument.shard": n % 10}) for n in range(40)]
        evens = hub.subscribe(lambda c: c["fullDocument"]["i"] % 2 == 0)
        both = hub.subscribe(lambda c: c["fullDocument"]["i"] < 50,
                             match={"operationType": "insert"})
        hub.start()
        orders.insert_many([{"i": i, "shard": i % 10} for i in range(200)])
        run_until(hub, 200)
    for n, subscription in enumerate(subscribers):
        got = [c["fullDocument"]["i"] for c in subscription]
        assert got == [i for i in range(200) if i % 10 == n % 10]
    assert [c["fullDocument"]["i"] for c in evens] == list(range(0, 200, 2))
    assert [c["fullDocument"]["i"] for c in both] == list(range(50))
    # The server saw one change stream for 42 subscribers: one aggregate, one cursor.
    assert listener.aggregates == 1
    assert len(listener.cursors) == 1


def test_a_slow_subscriber_gets_a_gap_marker_when_dropping_never_silent_loss(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, _ = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        slow = hub.subscribe(max_queue=5, on_full="drop")
        fast = hub.subscribe()
        hub.start()
        orders.insert_many([{"i": i} for i in range(50)])
        run_until(hub, 50)
    items = list(slow)
    changes = [x for x in items if not isinstance(x, changestream.Gap)]
    gaps = [x for x in items if isinstance(x, changestream.Gap)]
    assert [c["fullDocument"]["i"] for c in changes] == [0, 1, 2, 3, 4]
    assert len(gaps) == 1 and gaps[0].dropped == 45 == slow.dropped
    assert gaps[0].after_token == changes[-1]["_id"]
    assert len(list(fast)) == 50


def test_a_disconnect_subscriber_raises_after_its_queued_changes(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, _ = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        slow = hub.subscribe(max_queue=5, on_full="disconnect")
        other = hub.subscribe()
        hub.start()
        orders.insert_many([{"i": i} for i in range(20)])
        run_until(hub, 20)
    received = []
    with pytest.raises(changestream.SubscriberDisconnected, match="fell 5 changes behind"):
        for change in slow:
            received.append(change["fullDocument"]["i"])
    assert received == [0, 1, 2, 3, 4]
    assert len(list(other)) == 20


def test_a_blocking_subscriber_holds_the_hub_and_loses_nothing(
    setup: tuple[Any, Aggregates],
) -> None:
    orders, _ = setup
    with changestream.watch(orders, max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        slow = hub.subscribe(max_queue=2)  # "block", the default
        hub.start()
        orders.insert_many([{"i": i} for i in range(30)])
        time.sleep(0.5)
        assert hub.changes <= 4  # waiting for the subscriber: 2 queued, 1 being offered
        got = []
        for change in slow:
            got.append(change["fullDocument"]["i"])
            time.sleep(0.005)
            if len(got) == 30:
                hub.stop()
        hub.join(10)
    assert got == list(range(30))


def test_bad_subscription_options_are_one_clear_error(setup: tuple[Any, Aggregates]) -> None:
    orders, _ = setup
    with changestream.watch(orders) as stream:
        hub = changestream.Hub(stream)
        with pytest.raises(ValueError, match="on_full must be one of block, drop, disconnect"):
            hub.subscribe(on_full="spill")
        with pytest.raises(ValueError, match="max_queue must be an integer >= 1"):
            hub.subscribe(max_queue=0)
        with pytest.raises(ValueError, match=r"the operator '\$where'"):
            hub.subscribe(match={"a": {"$where": "x"}})


# -- the asyncio hub ---------------------------------------------------------------------------
def test_the_async_hub_shares_one_cursor_and_marks_gaps(simulator: Any) -> None:
    listener = Aggregates()

    async def main() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            simulator.uri, event_listeners=[listener])
        orders = client.shop.orders
        await orders.insert_one({"setup": True})
        async with await changestream.aio.watch(orders, max_await_time_ms=100) as stream:
            hub = changestream.aio.AsyncHub(stream)
            subscribers = [hub.subscribe(match={"fullDocument.i": {"$lt": n}}) for n in range(1, 21)]
            slow = hub.subscribe(max_queue=3, on_full="drop")
            task = asyncio.create_task(hub.run())
            await orders.insert_many([{"i": i} for i in range(60)])
            got = [[] for _ in subscribers]

            async def read(index: int) -> None:
                async for change in subscribers[index]:
                    got[index].append(change["fullDocument"]["i"])
                    if len(got[index]) == index + 1:
                        return

            await asyncio.wait_for(asyncio.gather(*(read(i) for i in range(20))), 30)
            while hub.changes < 60:
                await asyncio.sleep(0.02)
            hub.stop()
            await asyncio.wait_for(task, 10)
        assert got == [list(range(n)) for n in range(1, 21)]
        items = [item async for item in slow]
        gaps = [x for x in items if isinstance(x, changestream.Gap)]
        assert len(items) == 4 and len(gaps) == 1 and gaps[0].dropped == 57
        await client.close()

    asyncio.run(main())
    assert listener.aggregates == 1 and len(listener.cursors) == 1
