"""``spark.readStream.format("changestream")``: a PySpark streaming source whose offsets are resume tokens.

How PySpark 4.3 drives it (see ``docs/spark.md``): one long-lived driver-side
Python process calls ``initialOffset`` (twice: memoised), ``latestOffset``,
``partitions`` and ``commit`` on one reader object; executors receive a
*pickled* reader and a :class:`TokenRange` and call :meth:`read`. So:

* the driver reads the stream once, ahead of Spark (:mod:`._readahead`):
  ``latestOffset`` cuts at most ``ReadMaxRows`` buffered events and
  ``partitions`` ships their BSON to the executors inside the partitions,
  where :meth:`ChangeStreamReader.read` converts it to Arrow;
* a range the driver has no events for (a batch replayed from the checkpoint
  by a new run of the query) is read by :func:`read_range` on the executor, a
  pure function of the range: it reopens the stream after the start token and
  stops at the end token, so a replayed batch yields exactly the same events;
* when nothing happens the offset moves to the postBatchResumeToken now and
  then (``idle_advance_seconds``), keeping a restart inside the oplog window.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from bson.raw_bson import RawBSONDocument
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from .. import ChangeStream, watch
from .._snapshot import stream_start
from ..errors import ChangeStreamError
from ._config import SourceConfig, session_settings
from ._convert import DECODE_CHUNK, EventConverter, event_token, raw_bytes
from ._errors import history_lost_as_error
from ._infer import sample_ddl
from ._offsets import (
    make_offset,
    offset_token,
    offset_watch_option,
    same_position,
    token_data,
    token_passed,
)
from ._readahead import ReadAhead, Taken, unpack_chunks
from ._schema import event_ddl
from ._snapshot import SnapshotPlan, SnapshotRange, plan_snapshot, read_snapshot_range

__all__ = [
    "ChangeStreamDataSource",
    "ChangeStreamReader",
    "SnapshotBatchReader",
    "TokenRange",
    "read_range",
]


_WORKER_MAINS = frozenset({"pyspark.daemon", "pyspark.worker"})
"""``__main__`` of a PySpark Python worker process (forked by the daemon, or started alone)."""

def settle_worker() -> None:
    """Once per PySpark Python worker: move what is alive now (the imported modules) out of
    the cyclic garbage collector's reach.

    PySpark's daemon runs ``gc.collect()`` after every task of a reused worker, and a full
    collection walks every tracked object: with pyarrow, pandas, PyMongo and this package
    imported, ~90,000 objects and 55-90 ms of CPU per task, about as much as converting
    the task's 12,500 events (``docs/spark.md``, "Throughput"). ``gc.freeze()`` after one
    last full collection leaves those long-lived objects out of every later one; objects
    made by later tasks are collected as before. Only in a Spark worker process: a driver
    or a test calling :meth:`ChangeStreamReader.read` keeps its collector as it is.
    """
    if gc.get_freeze_count():
        return  # frozen already (by an earlier task of this worker): nothing to keep
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if getattr(spec, "name", None) in _WORKER_MAINS:
        gc.collect()
        gc.freeze()


class TokenRange(InputPartition):
    """The events after offset ``start`` up to and including offset ``end``.

    ``data`` (compressed BSON, :func:`._readahead.pack`) holds events the
    driver already read: a batch may be shipped as several such partitions,
    in order. Without it the executor reads the whole range.
    """

    def __init__(
        self, start: dict[str, Any], end: dict[str, Any], data: bytes | None = None
    ) -> None:
        super().__init__((start, end))
        self.start = start
        self.end = end
        self.data = data


class ChangeStreamDataSource(DataSource):
    """The data source registered as format ``"changestream"`` (options: ``docs/spark.md``)."""

    session_settings: tuple[tuple[str, str], ...] = ()
    """Session-wide ``spark.mongodb.read.*`` settings, read by :func:`with_session_settings`."""

    @classmethod
    def name(cls) -> str:
        return "changestream"

    def _config(self) -> SourceConfig:
        return SourceConfig.from_options(self.options, dict(self.session_settings))

    def schema(self) -> str:
        config = self._config()
        full_document_schema = config.full_document_schema
        if config.infer_schema and full_document_schema is None:
            full_document_schema = infer_schema(config)
        return event_ddl(
            full_document_schema,
            publish_full_document_only=config.publish_full_document_only,
        )

    def streamReader(self, schema: StructType) -> ChangeStreamReader:
        return ChangeStreamReader(self._config(), schema)

    def reader(self, schema: StructType) -> SnapshotBatchReader:
        """``spark.read.format("changestream")``: the collection at one cluster time."""
        return SnapshotBatchReader(self._config(), schema)


def with_session_settings(spark: Any) -> type[ChangeStreamDataSource]:
    """The data source class, with the session's ``spark.mongodb.read.*`` settings as defaults.

    Python data sources see only a query's own options, so the settings are
    read here, when the source is registered, and travel with the class
    (Spark pickles a class made at run time by value). A query's option beats
    a session setting of the same meaning, as in the MongoDB Spark connector.
    """
    settings = session_settings(spark.conf.getAll)
    if not settings:
        return ChangeStreamDataSource
    return type(
        "ChangeStreamDataSource",
        (ChangeStreamDataSource,),
        {
            "session_settings": tuple(sorted(settings.items())),
            "__module__": __name__,
            "__qualname__": "with_session_settings.<locals>.ChangeStreamDataSource",
        },
    )


class SnapshotBatchReader(DataSourceReader):
    """A batch read of one collection at one cluster time, one partition per ``_id`` range.

    The time is ``at_cluster_time`` or the server's choice; every row reports
    it in ``cluster_time``.
    """

    def __init__(self, config: SourceConfig, schema: StructType) -> None:
        if config.database is None or config.collection is None:
            raise ValueError(
                "spark.read.format('changestream') copies one collection: options 'database' and "
                "'collection' are required"
            )
        self._config = config
        self._converter = EventConverter(
            to_arrow_schema(schema, timezone="UTC"),
            publish_full_document_only=config.publish_full_document_only,
        )

    def partitions(self) -> Sequence[InputPartition]:
        config = self._config
        with history_lost_as_error(None):
            plan = plan_snapshot(config, config.snapshot_partitions, config.at_cluster_time)
        return [plan.partition(i) for i in range(plan.ranges)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        settle_worker()
        if not isinstance(partition, SnapshotRange):
            raise TypeError(f"expected a SnapshotRange partition, not {type(partition).__name__}")
        return read_snapshot_range(self._config, self._converter, partition)


def infer_schema(config: SourceConfig) -> str:
    """``infer_schema=true``: a ``full_document_schema`` from a sample of the watched collection."""
    assert config.database is not None and config.collection is not None
    with config.connect() as client, history_lost_as_error(None):
        return sample_ddl(client[config.database][config.collection],
                          config.infer_schema_sample_size)


class ChangeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reader over a change stream; offsets are resume tokens (``offsets.py``)."""

    def __init__(self, config: SourceConfig, schema: StructType) -> None:
        self._config = config
        self._converter = EventConverter(
            to_arrow_schema(schema, timezone="UTC"),
            publish_full_document_only=config.publish_full_document_only,
        )
        self._initial: dict[str, Any] | None = None
        self._readahead: ReadAhead | None = None
        self._target: Mapping[str, Any] | None = None  # Trigger.AvailableNow bound
        self._last_advance = time.monotonic()

    def __getstate__(self) -> dict[str, Any]:
        """Executors get the configuration only: no client, no driver stream, no buffer."""
        state = dict(self.__dict__)
        state["_readahead"] = None
        return state

    # -- driver side ---------------------------------------------------------------------------
    def initialOffset(self) -> dict[str, Any]:
        """The start of a new query, computed once (Spark calls this twice)."""
        if self._initial is None:
            config = self._config
            if config.startup_mode == "token":
                assert config.start_after is not None
                self._initial = make_offset(config.start_after, start_after=True)
            elif config.startup_mode == "snapshot":
                with history_lost_as_error(None):
                    plan = plan_snapshot(config, config.snapshot_partitions)
                self._initial = {"v": 1, "snapshot": plan.to_json(), "next": 0}
            else:
                self._initial = make_offset(self._current_token(config.start_at_operation_time))
        return self._initial

    def getDefaultReadLimit(self) -> ReadLimit:
        rows = self._config.max_rows_per_batch
        return ReadMaxRows(rows) if rows else ReadAllAvailable()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The end of the next batch: at most ``limit`` events after ``start``.

        The events come from the driver's read-ahead buffer; the end is the
        last one's token, or the ``availableNow`` target when every event
        before it is in the batch (so the run ends without an empty batch).
        Returns ``start`` itself when there is nothing new (Spark then plans
        no batch).
        """
        if "snapshot" in start:
            return self._copy_end(start)
        cap = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        if self._readahead is None:
            self._readahead = ReadAhead(self._config)
        readahead = self._readahead
        deadline = time.monotonic() + self._config.max_scan_ms / 1000
        try:
            with history_lost_as_error(offset_token(start)):
                taken = readahead.take(start, cap, self._target, deadline)
        except BaseException:
            readahead.close()  # its position is unknown now: reopen next time
            raise
        now = time.monotonic()
        if taken.events:
            self._last_advance = now
            bound = self._target if taken.reached_until else None
            end = make_offset(bound if bound is not None else taken.last)
            readahead.plan(start, end, taken)
            return end
        idle_end = self._idle_end(start, taken, now)
        if idle_end is None:
            return start
        self._last_advance = now
        end = make_offset(idle_end, idle=True)
        readahead.moved_to(end)  # no event between the two tokens
        return end

    def _copy_end(self, start: dict[str, Any]) -> dict[str, Any]:
        """During ``startup_mode=snapshot``: the next ranges, then the stream just after T."""
        plan = SnapshotPlan.from_json(start["snapshot"])
        done = int(start["next"])
        if done < plan.ranges:
            step = self._config.snapshot_ranges_per_batch or plan.ranges
            return {"v": 1, "snapshot": start["snapshot"], "next": min(plan.ranges, done + step)}
        self._last_advance = time.monotonic()
        return make_offset(self._current_token(stream_start(plan.at)))

    def _idle_end(self, start: dict[str, Any], scan: Taken, now: float) -> Any:
        """Where an idle stream may advance to (its postBatchResumeToken), or None."""
        token = scan.resume_token
        if not scan.caught_up or token is None or not token_passed(token, offset_token(start)):
            return None
        target = self._target
        if target is not None:
            # availableNow: one step straight to the target once the stream is at or past
            # it, never beyond; a token short of it ends the run (no trail of empty batches)
            reached = not token_passed(target, token)
            return target if reached and token_passed(target, offset_token(start)) else None
        if now - self._last_advance < self._config.idle_advance_seconds:
            return None
        return token

    def prepareForTriggerAvailableNow(self) -> None:
        """Bound the run by the stream's position now: later events wait for the next run."""
        self._target = self._current_token(None)

    def partitions(
        self, start: dict[str, Any], end: dict[str, Any]
    ) -> Sequence[TokenRange | SnapshotRange]:
        """The buffered events of the range (in order), or one partition the executor reads.

        During a snapshot copy: one partition per ``_id`` range of the batch
        (none for the step from the copy to the stream).
        """
        if "snapshot" in start:
            if "snapshot" not in end:
                return []
            plan = SnapshotPlan.from_json(start["snapshot"])
            return [plan.partition(i) for i in range(int(start["next"]), int(end["next"]))]
        if same_position(start, end) or end.get("idle"):
            return []
        packed = self._readahead.packed(start, end) if self._readahead is not None else None
        if packed is None:
            return [TokenRange(start, end)]
        return [TokenRange(start, end, data) for data in packed]

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: Spark's checkpoint is the durable record of progress."""

    def stop(self) -> None:
        """Close the driver's stream and client (PySpark 4.3 may end the process instead)."""
        if self._readahead is not None:
            self._readahead.shutdown()
            self._readahead = None

    def _current_token(self, start_at: Any) -> Mapping[str, Any]:
        """The postBatchResumeToken of a fresh stream (at ``start_at``, or now)."""
        config = self._config
        options = config.watch_options(with_lookups=False)
        options["batch_size"] = 0  # an empty first batch: the token is exactly the start
        if start_at is not None:
            options["start_at_operation_time"] = start_at
        with (
            config.connect() as client,
            history_lost_as_error(None),
            watch(config.target(client), list(config.pipeline), **options) as stream,
        ):
            token = stream.resume_token
        if token is None:
            raise ChangeStreamError(
                "the server returned no postBatchResumeToken; the changestream source needs "
                "MongoDB 4.0.7 or newer"
            )
        return token  # type: ignore[no-any-return]

    # -- executor side -------------------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        settle_worker()
        if isinstance(partition, SnapshotRange):
            return read_snapshot_range(self._config, self._converter, partition)
        if not isinstance(partition, TokenRange):
            raise TypeError(f"expected a TokenRange partition, not {type(partition).__name__}")
        if partition.data is not None:
            return self._convert(partition.data)
        return read_range(self._config, self._converter, partition)

    def _convert(self, data: bytes) -> Iterator[pa.RecordBatch]:
        """The events the driver shipped, as record batches of at most ``arrow_batch_rows``."""
        rows = self._config.arrow_batch_rows
        size = min(rows, DECODE_CHUNK)
        chunks = unpack_chunks(data, size)
        step = rows // size
        for first in range(0, len(chunks), step):
            yield self._converter.convert_joined(chunks[first : first + step])


def read_range(
    config: SourceConfig, converter: EventConverter, partition: TokenRange
) -> Iterator[pa.RecordBatch]:
    """The events of ``partition`` read from the server, as record batches of at most
    ``arrow_batch_rows`` rows."""
    end = offset_token(partition.end)
    with config.connect() as client, history_lost_as_error(offset_token(partition.start)):
        stream = watch(
            config.target(client),
            list(config.pipeline),
            **config.watch_options(),
            **offset_watch_option(partition.start),
            document_class=RawBSONDocument,
        )
        with stream:
            pending: list[Any] = []
            for event in _events_until(stream, end):
                pending.append(event)
                if len(pending) >= config.arrow_batch_rows:
                    yield converter.convert(pending, share_gil=False)
                    pending = []
            if pending:
                yield converter.convert(pending, share_gil=False)


def _events_until(stream: ChangeStream[Any], end: Mapping[str, Any]) -> Iterator[Any]:
    """Events up to and including token ``end``: equality first, token order as the fallback."""
    end_data = token_data(end)
    while True:
        event = stream.try_next()
        if event is None:
            token = stream.resume_token  # the postBatchResumeToken: the server is past it
            if token is not None and token_data(token) >= end_data:
                return
            if not stream.alive:
                raise ChangeStreamError(
                    f"the change stream closed before reaching the end of the batch ({end_data}); "
                    "was the collection dropped while the batch was replayed?"
                )
            continue
        raw = raw_bytes(event)
        data = token_data(event_token(raw))
        if data > end_data:
            return
        yield raw
        if data == end_data:
            return
