"""Helpers shared by the Spark tests and by ``pipeline_process.py`` (a plain module, no fixtures).

Spark's Python workers must run this venv's interpreter on loopback, so
:func:`spark_builder` sets ``PYSPARK_PYTHON`` and ``SPARK_LOCAL_IP`` before
the JVM starts.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

PANDAS_WARNING = "ignore:PySpark does not yet fully support pandas:FutureWarning"
"""PySpark 4.3 warns that pandas 3 is not fully supported; the adapter does not use pandas."""

SPARK_ENV = {"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}


def spark_builder() -> Any:
    """A ``local[2]`` session builder with small, fast settings."""
    os.environ.update(SPARK_ENV)
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master("local[2]")
        .appName("changestream-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.pollingDelay", "50ms")
    )


class ParquetSink:
    """An idempotent foreachBatch sink: batch N *replaces* ``batch-N.parquet`` atomically.

    ``hold_seconds`` keeps ``func`` running after the file of a batch with id
    ``>= hold_from`` is written (and marks it with a ``written-N`` file), so a
    test can kill the process between "output written" and "progress saved".
    """

    def __init__(self, directory: Path, hold_seconds: float = 0.0, hold_from: int = 0) -> None:
        self.directory = Path(directory)
        self.hold_seconds = hold_seconds
        self.hold_from = hold_from
        self.directory.mkdir(parents=True, exist_ok=True)

    def __call__(self, df: Any, batch_id: int) -> None:
        self.write(df.toArrow(), batch_id)
        if self.hold_seconds and batch_id >= self.hold_from:
            (self.directory / f"written-{batch_id:06d}").touch()
            time.sleep(self.hold_seconds)

    def write(self, table: Any, batch_id: int) -> None:
        fd, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        os.close(fd)
        pq.write_table(table, temporary)
        os.replace(temporary, self.directory / f"batch-{batch_id:06d}.parquet")

    def batches(self) -> dict[int, Any]:
        """``batch_id -> pyarrow.Table`` of every batch file."""
        return {
            int(path.stem.split("-")[1]): pq.read_table(path)
            for path in sorted(self.directory.glob("batch-*.parquet"))
        }

    def ids(self) -> list[Any]:
        """The document ``_id`` of every delivered event, in batch order (duplicates kept)."""
        return [
            json.loads(key)["_id"]
            for _, table in sorted(self.batches().items())
            for key in table.column("document_key").to_pylist()
        ]


def wait_for(condition: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    """Poll ``condition`` until it is truthy; raise (never hang) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def current_token(collection: Any) -> dict[str, Any]:
    """The stream position now (a postBatchResumeToken): events after this call come after it."""
    import changestream

    with changestream.watch(collection, batch_size=0) as stream:
        token = stream.resume_token
    assert token is not None
    return dict(token)
