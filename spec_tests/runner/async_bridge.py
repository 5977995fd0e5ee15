"""The asyncio side of the ``changestream-async`` client mode, kept in one place.

A test in that mode keeps CRUD, DDL, runCommand and failpoints on its
synchronous PyMongo clients (they only set the server up) but opens and
iterates its change streams on ``AsyncMongoClient`` *mirrors* of its client
entities: same URI, same keyword options (``uriOptions``, heartbeat,
``serverApi``) and the same command listeners, so ``expectEvents`` sees the
async stream's aggregate/getMore/killCursors exactly as it sees the sync ones.

:class:`AsyncBridge` owns one event loop per test, running in a helper thread
so the mirrors' monitors keep working between operations (as the sync
clients' monitor threads do); the runner's synchronous code submits
coroutines and blocks for their result. :class:`BridgedStream` gives the
synchronous change-stream surface the runner uses (``next``, ``try_next``,
``close``, ``alive``, ``resume_token``) over an async stream.
:meth:`AsyncBridge.close` closes streams, then clients, then the loop, and
reports anything left running, so nothing leaks into the next test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from pymongo import AsyncMongoClient, MongoClient
from pymongo.collection import Collection
from pymongo.database import Database

from . import RunnerError

_T = TypeVar("_T")

CLOSE_TIMEOUT_S = 20.0
"""How long closing a stream, a client or the loop may take (a stuck one is reported, not waited on)."""

DISCOVERY_WAIT_SECONDS = 10.0
"""How long a new async twin may take to discover a data-bearing server before the test runs."""


class _End:
    """Marks the end of a stream (``StopAsyncIteration``, or a cancelled wait)."""


_END = _End()


@dataclass
class _Mirror:
    """A synchronous client and its async twin (the sync client is kept so its id stays unique)."""

    client: MongoClient[Any]
    twin: AsyncMongoClient[Any]
    closed: bool = False


class AsyncBridge:
    """One event loop in a helper thread that owns a test's async clients and streams."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="spec-tests-async-bridge", daemon=True
        )
        self._thread.start()
        self._mirrors: dict[int, _Mirror] = {}
        self._streams: list[BridgedStream] = []
        self._closed = False

    # -- running coroutines ------------------------------------------------------------
    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Schedule ``coroutine`` on the bridge's loop."""
        if self._closed:
            coroutine.close()
            raise RunnerError("the async bridge is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def run(self, coroutine: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run ``coroutine`` on the loop and wait; its exception is raised here unchanged.

        After ``timeout`` seconds it is cancelled and a RunnerError says so.
        """
        name = getattr(coroutine, "__qualname__", "a coroutine")
        future = self.submit(coroutine)
        done, _ = concurrent.futures.wait([future], timeout)
        if not done:
            future.cancel()
            raise RunnerError(f"{name} did not finish within {timeout:.0f} s")
        return future.result()

    # -- clients ---------------------------------------------------------------------------
    def register(self, client: MongoClient[Any], uri: str, options: dict[str, Any]) -> None:
        """Create and connect the async twin of ``client`` (built from ``uri`` and ``options``).

        ``options`` are the keywords ``client`` was built with, listeners
        included; the twin starts monitoring now, as the sync client did.
        """
        if id(client) in self._mirrors:
            raise RunnerError("this client already has an async mirror")

        async def connect() -> AsyncMongoClient[Any]:
            twin: AsyncMongoClient[Any] = AsyncMongoClient(uri, **options)
            await twin.aconnect()
            # As entities.await_discovery for sync clients: discovery is not the test's.
            deadline = asyncio.get_running_loop().time() + DISCOVERY_WAIT_SECONDS
            while not twin.topology_description.has_writable_server():
                if asyncio.get_running_loop().time() > deadline or _unreachable(twin):
                    break
                await asyncio.sleep(0.002)
            return twin

        self._mirrors[id(client)] = _Mirror(client, self.run(connect()))

    def mirror(self, target: Any) -> Any:
        """The async twin of a registered MongoClient, or of a Database/Collection of one."""
        if isinstance(target, MongoClient):
            mirror = self._mirrors.get(id(target))
            if mirror is None:
                raise RunnerError("this MongoClient has no async mirror (register it first)")
            if mirror.closed:
                raise RunnerError("the async mirror of this client is closed")
            return mirror.twin
        if isinstance(target, Database):
            return self.mirror(target.client).get_database(target.name, **_settings(target))
        if isinstance(target, Collection):
            return self.mirror(target.database).get_collection(target.name, **_settings(target))
        raise RunnerError(f"cannot mirror a {type(target).__name__} on an AsyncMongoClient")

    def close_client(self, client: MongoClient[Any]) -> None:
        """Close the async twin of ``client`` (idempotent; PyMongo errors propagate)."""
        mirror = self._mirrors.get(id(client))
        if mirror is not None and not mirror.closed:
            mirror.closed = True
            self.run(mirror.twin.close(), CLOSE_TIMEOUT_S)

    # -- streams -----------------------------------------------------------------------------
    def open_stream(self, opening: Coroutine[Any, Any, Any]) -> BridgedStream:
        """Run ``opening`` (e.g. ``changestream.aio.watch(...)``) and wrap the stream it returns."""
        stream = BridgedStream(self, self.run(opening))
        self._streams.append(stream)
        return stream

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> list[str]:
        """Close streams, then clients, then the loop; return what went wrong (never raise)."""
        if self._closed:
            return []
        problems: list[str] = []
        for stream in self._streams:
            try:
                stream.close()
            except RunnerError as exc:  # stuck
                problems.append(f"closing an async change stream: {exc}")
            except Exception:  # the spec: suppress errors closing cursors
                pass
        self._streams.clear()
        for mirror in self._mirrors.values():
            try:
                self.close_client(mirror.client)
            except Exception as exc:
                problems.append(f"closing an AsyncMongoClient: {exc!r}")
        self._mirrors.clear()
        try:
            leftovers = self.run(_cancel_leftovers(), CLOSE_TIMEOUT_S)
        except Exception as exc:
            problems.append(f"stopping the async bridge's tasks: {exc!r}")
        else:
            if leftovers:
                problems.append(
                    f"asyncio tasks still running after the clients closed: {leftovers}"
                )
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            problems.append(f"the async bridge's loop did not stop within {CLOSE_TIMEOUT_S:.0f} s")
        else:
            self._loop.close()
        return problems


def _unreachable(client: AsyncMongoClient[Any]) -> bool:
    """Every server was checked and failed: waiting for discovery would only wait."""
    servers = client.topology_description.server_descriptions().values()
    return bool(servers) and all(sd.error is not None for sd in servers)


async def _cancel_leftovers() -> list[str]:
    """Cancel every other task on the loop; return their names (none is expected)."""
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S / 2)
    return sorted(task.get_name() for task in tasks)


def _settings(target: Database[Any] | Collection[Any]) -> dict[str, Any]:
    """The codec, read/write settings a Database or Collection carries (its twin gets the same)."""
    return {
        "codec_options": target.codec_options,
        "read_preference": target.read_preference,
        "write_concern": target.write_concern,
        "read_concern": target.read_concern,
    }


async def _next_or_end(stream: Any) -> Any:
    """``await stream.next()``, with the end of the stream as a value (it cannot cross threads)."""
    try:
        return await stream.next()
    except StopAsyncIteration:
        return _END


class BridgedStream:
    """The synchronous change-stream surface the runner uses, over an async stream on the loop.

    :meth:`close` from another thread (the runner's iteration time limit)
    cancels a waiting :meth:`next`, which for ``changestream.aio`` closes the
    stream and kills its cursor; the waiting call then ends as if the stream
    were closed, once the cancellation has run.
    """

    def __init__(self, bridge: AsyncBridge, stream: Any) -> None:
        self._bridge = bridge
        self._stream = stream
        self._task: asyncio.Task[Any] | None = None
        """The task of the call in progress (read and written on the loop only)."""

    def next(self) -> Any:
        """The next change; ``StopIteration`` once the stream is closed."""
        document = self._call(_next_or_end(self._stream))
        if document is _END:
            raise StopIteration
        return document

    __next__ = next

    def __iter__(self) -> BridgedStream:
        return self

    def try_next(self) -> Any:
        """A change if one is ready after at most one getMore, else None."""
        document = self._call(self._stream.try_next())
        return None if document is _END else document

    def close(self) -> None:
        """Close the stream, cancelling a waiting :meth:`next` first; errors propagate."""
        self._bridge.run(self._close(), CLOSE_TIMEOUT_S)

    @property
    def alive(self) -> bool:
        return bool(self._stream.alive)

    @property
    def resume_token(self) -> Any:
        return self._stream.resume_token

    def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        try:
            return self._bridge.run(self._tracked(coroutine))
        except concurrent.futures.CancelledError:
            return _END  # close() cancelled the wait: the stream is closed

    async def _tracked(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        self._task = asyncio.current_task()
        try:
            return await coroutine
        finally:
            self._task = None

    async def _close(self) -> None:
        task = self._task
        if task is not None:
            task.cancel()
        await self._stream.close()
