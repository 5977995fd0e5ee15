"""The async stream shows the same position, lag and resume count as the sync one."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from pymongo import AsyncMongoClient

import changestream.aio


def test_async_stream_position_lag_and_resumes(simulator: Any) -> None:
    async def run() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(simulator.uri)
        try:
            stream = await changestream.aio.watch(client.db.coll, max_await_time_ms=50)
            async with stream:
                await client.db.coll.insert_many([{"i": i} for i in range(3)])
                await client.admin.command(
                    "configureFailPoint", "failCommand", mode={"times": 1},
                    data={"failCommands": ["getMore"], "closeConnection": True},
                )
                seen = []
                for _ in range(200):
                    change = await stream.try_next()
                    if change is not None:
                        seen.append(change)
                    if len(seen) == 3:
                        break
                assert len(seen) == 3 and stream.resumes == 1
                token_time = stream.position.token_time
                assert token_time is not None and token_time >= seen[-1]["clusterTime"]
                assert stream.lag is not None and stream.lag <= timedelta(seconds=5)
        finally:
            await client.close()

    asyncio.run(run())
