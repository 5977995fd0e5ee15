"""Fixtures for the Spark suite: one local SparkSession, a fresh collection, a file sink.

Every test here is marked ``spark`` (excluded from the default run); run them
with ``python -m pytest -m spark tests/spark``. The deployment is the
``mongodb_uri`` of ``tests/conftest.py`` (an in-process simulator, or the
real ``MONGODB_URI``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="the spark suite needs pyspark")
pytest.importorskip("pyarrow", reason="the spark suite needs pyarrow")

from pymongo import MongoClient
from pymongo.collection import Collection
from spark_support import ParquetSink, spark_builder


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One SparkSession for the whole suite, with the ``changestream`` source registered."""
    from changestream.spark_adapter import register

    session = spark_builder().getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def coll(mongo_client: MongoClient[dict[str, Any]]) -> Iterator[Collection[dict[str, Any]]]:
    """A fresh collection in a fresh database (dropped afterwards)."""
    name = f"spark_{uuid.uuid4().hex[:10]}"
    try:
        yield mongo_client[name]["events"]
    finally:
        mongo_client.drop_database(name)


@pytest.fixture
def sink(tmp_path: Path) -> ParquetSink:
    return ParquetSink(tmp_path / "out")
