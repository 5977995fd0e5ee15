"""Spark integration: ``foreach_batch`` (a loop you run) and the ``changestream`` data source.

Both produce the same rows (:func:`event_ddl`) and give exactly-once results
with an idempotent sink; see ``docs/spark.md``. Needs the ``spark`` extra
(pyspark, pyarrow).
"""

from __future__ import annotations

from typing import Any

try:
    import pyarrow  # noqa: F401
    import pyspark  # noqa: F401
except ImportError as exc:  # one clear error instead of a missing module deep inside
    raise ImportError(
        "changestream.spark_adapter needs the 'spark' extra: "
        f"pip install 'changestream[spark]' ({exc})"
    ) from exc

from ._batches import BatchRunResult, foreach_batch, stream_opener
from ._config import MONGO_SPARK_ALIASES
from ._errors import (
    ChangeStreamHistoryLostError,
    ChangeStreamInvalidatedError,
    SchemaMismatchError,
)
from ._infer import infer_ddl
from ._merge import merge_into, merge_into_tables, merge_ready, stage_into
from ._schema import ENVELOPE_COLUMNS, event_ddl
from ._source import ChangeStreamDataSource, ChangeStreamReader, with_session_settings

__all__ = [
    "ENVELOPE_COLUMNS",
    "MONGO_SPARK_ALIASES",
    "BatchRunResult",
    "ChangeStreamDataSource",
    "ChangeStreamHistoryLostError",
    "ChangeStreamInvalidatedError",
    "ChangeStreamReader",
    "SchemaMismatchError",
    "event_ddl",
    "foreach_batch",
    "infer_ddl",
    "merge_into",
    "merge_into_tables",
    "merge_ready",
    "register",
    "stage_into",
    "stream_opener",
]


def register(spark: Any) -> None:
    """Register the data source so ``spark.readStream.format("changestream")`` finds it.

    The session's ``spark.mongodb.read.*`` settings as they are now become
    defaults of every query's options (register again after changing them).
    """
    spark.dataSource.register(with_session_settings(spark))
