"""A parallel consumer for the chaos suite, run as a child process and killed with SIGKILL.

    python tests/chaos/parallel_consumer.py URI DB COLL TOKEN_FILE sync|async WORKERS MAX_IN_FLIGHT

``consume`` (threads) or ``aio.consume`` (tasks) with ``workers``, a key of
``_id % 16`` (16 lanes, so per-key order is checked on interleaved keys), a
handler sleeping 0 to 2 ms at random, the token in a file. Prints the ``_id``
of each handled change on stdout (one line, flushed) as the handler returns.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from typing import Any

from pymongo import AsyncMongoClient, MongoClient

import changestream
import changestream.aio
from changestream.stores import FileTokenStore

LANES = 16


def key(change: Any) -> int:
    return int(change["documentKey"]["_id"]) % LANES


def main() -> None:
    uri, db, coll_name, token_file, mode, workers, max_in_flight = sys.argv[1:8]
    store = FileTokenStore(token_file)
    lock = threading.Lock()
    options: dict[str, Any] = {"workers": int(workers), "max_in_flight": int(max_in_flight),
                               "key": key, "retry_for": None, "backoff_initial": 0.1,
                               "backoff_max": 1.0, "call_timeout": 30}

    def emit(change: Any) -> None:
        with lock:
            sys.stdout.write(f"{change['documentKey']['_id']}\n")
            sys.stdout.flush()

    if mode == "sync":
        rng = random.Random()

        def handle(change: Any) -> None:
            time.sleep(rng.random() * 0.002)
            emit(change)

        with MongoClient(uri) as client:
            coll = client[db][coll_name]
            changestream.consume(
                lambda token: changestream.watch(coll, resume_after=token, max_await_time_ms=100),
                handle, store, **options)
        return

    async def run() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
        coll = client[db][coll_name]
        rng = random.Random()

        async def handle(change: Any) -> None:
            await asyncio.sleep(rng.random() * 0.002)
            emit(change)

        async def open_stream(token: Any) -> Any:
            return await changestream.aio.watch(coll, resume_after=token, max_await_time_ms=100)

        try:
            await changestream.aio.consume(open_stream, handle, store, **options)
        finally:
            await client.close()

    asyncio.run(run())


if __name__ == "__main__":
    main()
