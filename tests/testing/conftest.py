"""Fixtures for the simulator's own tests: replica sets started per test, and their clients.

These tests exercise ``changestream.testing`` itself, so they always run against the
simulator (``MONGODB_URI`` does not apply here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pymongo import MongoClient

from changestream.testing import ReplicaSet

Client = MongoClient[dict[str, Any]]


@pytest.fixture
def start_rs() -> Iterator[Callable[..., ReplicaSet]]:
    """Start replica sets that outlive the test's clients (stopped after them)."""
    started: list[ReplicaSet] = []

    def start(*args: Any, **kwargs: Any) -> ReplicaSet:
        rs = ReplicaSet(*args, **kwargs).start()
        started.append(rs)
        return rs

    yield start
    for rs in started:
        rs.stop()


@pytest.fixture
def clients(start_rs: Any) -> Iterator[Callable[..., Client]]:
    """``clients(uri, **options)``: MongoClients closed after the test (before ``start_rs`` stops)."""
    made: list[Client] = []

    def make(uri: str, **kwargs: Any) -> Client:
        kwargs.setdefault("serverSelectionTimeoutMS", 5000)
        client: Client = MongoClient(uri, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()
