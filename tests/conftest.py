"""Shared fixtures: the MongoDB deployment that server-facing tests talk to.

With ``MONGODB_URI`` set, every server-facing test runs against that real
deployment; otherwise one in-process simulator
(:class:`changestream.testing.ReplicaSet`) is started for the session.
Tests that need something only the simulator can do (``step_down()``,
oplog rollover, a chosen server version) ask for ``simulator`` and are
skipped, with the reason printed, against a real deployment.

The stream tests (``tests/client/test_stream_sim.py``, ``tests/aio``) use
``deployment`` instead: a three-member simulated replica set per test module
(module scope, because their failover tests change the primary), with
``recorder``, ``admin`` and ``names`` on top. Plain helpers live in ``support.py``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import PyMongoError
from support import NEEDS_SIMULATOR, Deployment, Recorder, probe

REAL_URI = os.environ.get("MONGODB_URI")


@pytest.fixture(scope="session")
def mongodb_uri() -> Iterator[str]:
    """URI of the deployment under test (real, or a simulated 8.0 replica set)."""
    if REAL_URI:
        yield REAL_URI
        return
    from changestream.testing import ReplicaSet

    with ReplicaSet("8.0") as rs:
        yield rs.uri


@pytest.fixture
def simulator() -> Iterator[Any]:
    """A fresh simulated replica set; skipped against a real deployment."""
    if REAL_URI:
        pytest.skip(NEEDS_SIMULATOR)
    from changestream.testing import ReplicaSet

    with ReplicaSet("8.0") as rs:
        yield rs


@pytest.fixture
def mongo_client(mongodb_uri: str) -> Iterator[MongoClient[dict[str, Any]]]:
    client: MongoClient[dict[str, Any]] = MongoClient(mongodb_uri, serverSelectionTimeoutMS=10000)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def test_db(mongo_client: MongoClient[dict[str, Any]]) -> Iterator[Database[dict[str, Any]]]:
    """A database with a unique name, dropped afterwards."""
    name = f"cs_test_{uuid.uuid4().hex[:10]}"
    try:
        yield mongo_client[name]
    finally:
        mongo_client.drop_database(name)


@pytest.fixture
def test_coll(test_db: Database[dict[str, Any]]) -> Collection[dict[str, Any]]:
    """An (initially absent) collection in :func:`test_db`."""
    return test_db["coll"]


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    """A simulated three-member replica set for this module, or ``MONGODB_URI`` if it can stream."""
    if REAL_URI:
        reason = probe(REAL_URI)
        if reason:
            pytest.skip(f"MONGODB_URI cannot run change streams: {reason}")
        yield Deployment(REAL_URI)
        return
    from changestream.testing import ReplicaSet

    with ReplicaSet("8.0", members=3) as rs:
        yield Deployment(rs.uri, rs)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def admin(deployment: Deployment) -> Iterator[MongoClient[dict[str, Any]]]:
    """An unobserved client for writes and failpoints (failpoints are switched off after)."""
    mongo: MongoClient[dict[str, Any]] = MongoClient(deployment.uri, serverSelectionTimeoutMS=5000)
    yield mongo
    with contextlib.suppress(PyMongoError):
        for name in ("failCommand", "failGetMoreAfterCursorCheckout"):
            mongo.admin.command({"configureFailPoint": name, "mode": "off"})
    mongo.close()


@pytest.fixture
def fail_point(mongodb_uri: str) -> Iterator[Callable[..., None]]:
    """``fail_point(mode, **data)`` configures ``failCommand`` on :func:`mongodb_uri`; off afterwards."""
    admin: MongoClient[dict[str, Any]] = MongoClient(mongodb_uri)

    def configure(mode: Any, **data: Any) -> None:
        admin.admin.command("configureFailPoint", "failCommand", mode=mode, data=data)

    yield configure
    with contextlib.suppress(PyMongoError):
        configure("off")
    admin.close()


@pytest.fixture
def names(admin: MongoClient[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """A fresh ``(database, collection)`` pair, created through ``admin`` and dropped afterwards."""
    database = f"cs_{uuid.uuid4().hex[:10]}"
    admin[database].create_collection("coll")
    yield database, "coll"
    admin.drop_database(database)
