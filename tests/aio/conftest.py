"""Fixtures for the async tests: an asyncio runner over the shared ``deployment``.

pytest-asyncio is not used: each test builds an ``async def`` scenario and
hands it to the ``run`` fixture, which opens an observed ``AsyncMongoClient``
inside ``asyncio.run``. Writes and failpoints go through a plain sync client.
``deployment``, ``recorder``, ``admin`` and ``names`` come from ``tests/conftest.py``
(shared with the sync stream tests). With ``MONGODB_URI`` set, the tests run against
that deployment; tests that drive the simulator itself (failover, killed cursors)
are then skipped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aio_support import Ctx, Scenario
from pymongo import AsyncMongoClient, MongoClient
from support import Deployment, Recorder


@pytest.fixture
def run(
    deployment: Deployment,
    admin: MongoClient[dict[str, Any]],
    names: tuple[str, str],
    recorder: Recorder,
) -> Callable[..., None]:
    """``run(scenario, **client_options)``: run an async scenario with a fresh observed client."""

    def runner(scenario: Scenario, **client_options: Any) -> None:
        async def main() -> None:
            client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
                deployment.uri, event_listeners=[recorder], serverSelectionTimeoutMS=5000,
                **client_options,
            )
            try:
                ctx = Ctx(deployment, client, client[names[0]][names[1]],
                          admin[names[0]][names[1]], admin, recorder)
                await scenario(ctx)
            finally:
                await client.close()

        asyncio.run(main())

    return runner
