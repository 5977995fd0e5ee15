"""Fixtures for the async tests: a deployment, a command recorder and an asyncio runner.

pytest-asyncio is not used: each test builds an ``async def`` scenario and
hands it to the ``run`` fixture, which opens an observed ``AsyncMongoClient``
inside ``asyncio.run``. Writes and failpoints go through a plain sync client.
With ``MONGODB_URI`` set, the tests run against that deployment; tests that
drive the simulator itself (failover, killed cursors) are then skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aio_support import Ctx, Deployment, Recorder, Scenario
from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import PyMongoError


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    uri = os.environ.get("MONGODB_URI")
    if uri:
        yield Deployment(uri)
        return
    from changestream.testing import ReplicaSet

    with ReplicaSet("8.0", members=3) as rs:
        yield Deployment(rs.uri, rs)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def admin(deployment: Deployment) -> Iterator[MongoClient[dict[str, Any]]]:
    mongo: MongoClient[dict[str, Any]] = MongoClient(deployment.uri, serverSelectionTimeoutMS=5000)
    yield mongo
    with contextlib.suppress(PyMongoError):
        for name in ("failCommand", "failGetMoreAfterCursorCheckout"):
            mongo.admin.command({"configureFailPoint": name, "mode": "off"})
    mongo.close()


@pytest.fixture
def names(admin: MongoClient[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    database = f"cs_aio_{uuid.uuid4().hex[:10]}"
    admin[database].create_collection("coll")
    yield database, "coll"
    admin.drop_database(database)


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
