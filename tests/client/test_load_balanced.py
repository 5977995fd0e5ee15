"""The client in load-balanced mode (load-balancers spec), against the simulator's LB.

The cursor lives on the connection its aggregate ran on: getMore and killCursors
go there, the connection stays checked out while the cursor is open and is
checked in when it is closed or exhausted, and after a network error on it no
killCursors is sent: the resume opens a new connection.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from pymongo import AsyncMongoClient, monitoring

import changestream
from changestream.testing import ShardedCluster


class Pool(monitoring.ConnectionPoolListener):
    """Checked-out connections and which connection each command ran on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.out: set[Any] = set()

    def connection_checked_out(self, event: Any) -> None:
        with self.lock:
            self.out.add((event.address, event.connection_id))

    def connection_checked_in(self, event: Any) -> None:
        with self.lock:
            self.out.discard((event.address, event.connection_id))

    def connection_closed(self, event: Any) -> None:
        with self.lock:
            self.out.discard((event.address, event.connection_id))

    def pool_created(self, event: Any) -> None: ...
    def pool_ready(self, event: Any) -> None: ...
    def pool_cleared(self, event: Any) -> None: ...
    def pool_closed(self, event: Any) -> None: ...
    def connection_created(self, event: Any) -> None: ...
    def connection_ready(self, event: Any) -> None: ...
    def connection_check_out_started(self, event: Any) -> None: ...
    def connection_check_out_failed(self, event: Any) -> None: ...


class Commands(monitoring.CommandListener):
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    def started(self, event: Any) -> None:
        self.log.append((event.command_name, (event.service_id, event.server_connection_id)))

    def succeeded(self, event: Any) -> None: ...
    def failed(self, event: Any) -> None: ...

    def names(self) -> list[str]:
        return [name for name, _ in self.log if name in ("aggregate", "getMore", "killCursors")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[ShardedCluster]:
    with ShardedCluster("8.0", shards=2, mongoses=2, load_balancer=True, noop_interval=0.2) as c:
        pymongo.MongoClient(c.mongos_uri(0), directConnection=True).admin.command(
            "shardCollection", "lb.c", key={"_id": "hashed"}
        )
        yield c


def _writer(cluster: ShardedCluster) -> pymongo.MongoClient[Any]:
    return pymongo.MongoClient(cluster.mongos_uri(0), directConnection=True)


def _wait(check: Any, what: str) -> None:
    end = time.monotonic() + 20
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_the_stream_pins_one_connection_and_releases_it_on_close(cluster: ShardedCluster) -> None:
    pool, commands = Pool(), Commands()
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(
        cluster.lb_uri, event_listeners=[pool, commands]
    )
    writer = _writer(cluster)
    try:
        stream = changestream.watch(client.lb.c, max_await_time_ms=200)
        assert len(pool.out) == 1, "the aggregate's connection stays checked out"
        writer.lb.c.insert_many([{"_id": f"p{i}"} for i in range(4)])
        got = [stream.next()["documentKey"]["_id"] for _ in range(4)]
        assert sorted(got) == [f"p{i}" for i in range(4)]
        cursor_conns = {conn for name, conn in commands.log if name in ("aggregate", "getMore")}
        assert len(cursor_conns) == 1, "every getMore ran on the aggregate's connection"
        stream.close()
        assert commands.names()[-1] == "killCursors"
        assert commands.log[-1][1] in cursor_conns
        assert pool.out == set(), "the pin is released on close"
    finally:
        client.close()
        writer.close()


def test_a_network_error_resumes_on_a_new_connection_without_kill_cursors(
    cluster: ShardedCluster,
) -> None:
    pool, commands = Pool(), Commands()
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(
        cluster.lb_uri, event_listeners=[pool, commands]
    )
    writer = _writer(cluster)
    try:
        with changestream.watch(client.lb.c, max_await_time_ms=200) as stream:
            writer.lb.c.insert_one({"_id": "n0"})
            assert stream.next()["documentKey"]["_id"] == "n0"
            first = {conn for name, conn in commands.log if name == "aggregate"}
            assert cluster.balancer is not None
            cluster.balancer.drop_connections()
            writer.lb.c.insert_one({"_id": "n1"})
            assert stream.next()["documentKey"]["_id"] == "n1"
            names = commands.names()
            assert names.count("aggregate") == 2
            assert "killCursors" not in names, "no killCursors after a network error"
            second = [conn for name, conn in commands.log if name == "aggregate"][-1]
            assert second not in first, "the resume ran on a new connection"
            assert len(pool.out) == 1
        assert pool.out == set()
    finally:
        client.close()
        writer.close()


def test_async_twin_pins_and_releases(cluster: ShardedCluster) -> None:
    from changestream.aio import watch

    pool, commands = Pool(), Commands()
    writer = _writer(cluster)

    async def scenario() -> None:
        client: AsyncMongoClient[Any] = AsyncMongoClient(
            cluster.lb_uri, event_listeners=[pool, commands]
        )
        try:
            stream = await watch(client.lb.c, max_await_time_ms=200)
            assert len(pool.out) == 1
            await asyncio.to_thread(writer.lb.c.insert_one, {"_id": "a0"})
            assert (await stream.next())["documentKey"]["_id"] == "a0"
            conns = {conn for name, conn in commands.log if name in ("aggregate", "getMore")}
            assert len(conns) == 1
            await stream.close()
            assert commands.names()[-1] == "killCursors"
            assert pool.out == set()
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        writer.close()


def test_the_cursor_dies_with_its_connection_on_the_mongos(cluster: ShardedCluster) -> None:
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(cluster.lb_uri)
    try:
        stream = changestream.watch(client.lb.c, max_await_time_ms=200)
        mongoses = [cluster.mongos(i) for i in range(2)]
        _wait(lambda: sum(len(m.deployment.cursors.ids()) for m in mongoses) == 1, "a cursor")
        assert cluster.balancer is not None
        cluster.balancer.drop_connections()
        _wait(lambda: sum(len(m.deployment.cursors.ids()) for m in mongoses) == 0, "no cursor")
        stream.close()
    finally:
        client.close()
