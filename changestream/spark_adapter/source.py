"""``spark.readStream.format("changestream")``: a PySpark streaming source whose offsets are resume tokens.

How PySpark 4.3 drives it (see ``docs/spark.md``): one long-lived driver-side
Python process calls ``initialOffset`` (twice: memoised), ``latestOffset``,
``partitions`` and ``commit`` on one reader object; executors receive a
*pickled* reader and a :class:`TokenRange` and call :meth:`read`. So:

* the driver finds each batch's end with a token-only scan (same pipeline,
  ``$project`` of ``_id``/``operationType``), capped by ``ReadMaxRows``, and
  keeps that stream open between triggers while it stays in step;
* :meth:`ChangeStreamReader.read` is a pure function of the range: it reopens
  the stream after the start token and stops at the end token, so a batch
  replayed after a failure yields exactly the same events;
* when nothing happens the offset moves to the postBatchResumeToken now and
  then (``idle_advance_seconds``), keeping a restart inside the oplog window.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from ..api import watch
from ..errors import ChangeStreamError
from ..stream import ChangeStream
from .config import SourceConfig
from .convert import EventConverter
from .errors import ChangeStreamInvalidatedError, history_lost_as_error
from .offsets import (
    make_offset,
    offset_token,
    offset_watch_option,
    same_position,
    token_data,
    token_passed,
)
from .schema import event_ddl

__all__ = ["ChangeStreamDataSource", "ChangeStreamReader", "TokenRange", "read_range"]

_TOKEN_ONLY = {"$project": {"_id": 1, "operationType": 1}}


class TokenRange(InputPartition):
    """One micro-batch: the events after offset ``start`` up to and including offset ``end``."""

    def __init__(self, start: dict[str, Any], end: dict[str, Any]) -> None:
        super().__init__((start, end))
        self.start = start
        self.end = end


class ChangeStreamDataSource(DataSource):
    """The data source registered as format ``"changestream"`` (options: ``docs/spark.md``)."""

    @classmethod
    def name(cls) -> str:
        return "changestream"

    def schema(self) -> str:
        config = SourceConfig.from_options(self.options)
        return event_ddl(
            config.full_document_schema,
            publish_full_document_only=config.publish_full_document_only,
        )

    def streamReader(self, schema: StructType) -> ChangeStreamReader:
        return ChangeStreamReader(SourceConfig.from_options(self.options), schema)


@dataclasses.dataclass
class _Scan:
    """What one driver scan found."""

    last: Mapping[str, Any] | None  # token of the last event taken
    caught_up: bool  # the server had nothing more (an empty getMore)
    resume_token: Mapping[str, Any] | None  # the stream's token after the scan


class _TokenScanner:
    """Driver-only token stream that finds batch ends; stays open while it is in step."""

    def __init__(self, config: SourceConfig) -> None:
        self._config = config
        self._client: Any = None
        self._stream: ChangeStream[Any] | None = None
        self._position: Any = None  # offset["token"] the stream has consumed up to
        self._peeked: Any = None  # an event read past the last bound, not yet taken

    def scan(
        self,
        start: dict[str, Any],
        cap: int | None,
        until: Mapping[str, Any] | None,
        deadline: float,
    ) -> _Scan:
        stream = self._open_at(start)
        last: Mapping[str, Any] | None = None
        taken = 0
        caught_up = False
        while (cap is None or taken < cap) and time.monotonic() < deadline:
            event = self._peeked if self._peeked is not None else stream.try_next()
            self._peeked = None
            if event is None:
                caught_up = True
                if not stream.alive and last is None:  # closed by an invalidate we filtered out
                    raise ChangeStreamInvalidatedError(stream.resume_token)
                break
            token = event["_id"]
            if event.get("operationType") == "invalidate" or (
                until is not None and token_passed(token, until)
            ):
                self._peeked = event
                if last is None and event.get("operationType") == "invalidate":
                    raise ChangeStreamInvalidatedError(token)
                break
            last = token
            taken += 1
        if last is not None:
            self._position = make_offset(last)["token"]
        return _Scan(last, caught_up, stream.resume_token)

    def close(self) -> None:
        """Forget the stream (the client stays for the next one)."""
        if self._stream is not None:
            self._stream.close()
        self._stream = self._peeked = self._position = None

    def shutdown(self) -> None:
        """Close the stream and the client."""
        self.close()
        if self._client is not None:
            self._client.close()
            self._client = None

    def moved_to(self, offset: dict[str, Any]) -> None:
        """The stream's position is now ``offset`` (after an idle advance to its own token)."""
        self._position = offset["token"]

    def _open_at(self, start: dict[str, Any]) -> ChangeStream[Any]:
        stream = self._stream
        if stream is not None and stream.alive and self._position == start["token"]:
            return stream
        self.close()
        config = self._config
        if self._client is None:
            self._client = config.connect()
        # Lookups cannot change which events match unless the user pipeline looks at them.
        options = config.watch_options(with_lookups=bool(config.pipeline))
        stream = watch(
            config.target(self._client),
            [*config.pipeline, _TOKEN_ONLY],
            **options,
            **offset_watch_option(start),
        )
        self._stream, self._position = stream, start["token"]
        return stream


class ChangeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reader over a change stream; offsets are resume tokens (``offsets.py``)."""

    def __init__(self, config: SourceConfig, schema: StructType) -> None:
        self._config = config
        self._converter = EventConverter(
            to_arrow_schema(schema, timezone="UTC"),
            publish_full_document_only=config.publish_full_document_only,
        )
        self._initial: dict[str, Any] | None = None
        self._scanner: _TokenScanner | None = None
        self._target: Mapping[str, Any] | None = None  # Trigger.AvailableNow bound
        self._last_advance = time.monotonic()

    def __getstate__(self) -> dict[str, Any]:
        """Executors get the configuration only: no client, no driver stream."""
        state = dict(self.__dict__)
        state["_scanner"] = None
        return state

    # -- driver side ---------------------------------------------------------------------------
    def initialOffset(self) -> dict[str, Any]:
        """The start of a new query, computed once (Spark calls this twice)."""
        if self._initial is None:
            config = self._config
            if config.startup_mode == "token":
                assert config.start_after is not None
                self._initial = make_offset(config.start_after, start_after=True)
            else:
                self._initial = make_offset(self._current_token(config.start_at_operation_time))
        return self._initial

    def getDefaultReadLimit(self) -> ReadLimit:
        rows = self._config.max_rows_per_batch
        return ReadMaxRows(rows) if rows else ReadAllAvailable()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The end of the next batch: at most ``limit`` events after ``start``.

        Returns ``start`` itself when there is nothing new (Spark then plans no batch).
        """
        cap = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        if self._scanner is None:
            self._scanner = _TokenScanner(self._config)
        deadline = time.monotonic() + self._config.max_scan_ms / 1000
        try:
            with history_lost_as_error(offset_token(start)):
                scan = self._scanner.scan(start, cap, self._target, deadline)
        except BaseException:
            self._scanner.close()  # its position is unknown now: reopen next time
            raise
        now = time.monotonic()
        if scan.last is not None:
            self._last_advance = now
            return make_offset(scan.last)
        idle_end = self._idle_end(start, scan, now)
        if idle_end is None:
            return start
        self._last_advance = now
        end = make_offset(idle_end, idle=True)
        if idle_end is scan.resume_token:
            self._scanner.moved_to(end)
        return end

    def _idle_end(self, start: dict[str, Any], scan: _Scan, now: float) -> Any:
        """Where an idle stream may advance to (its postBatchResumeToken), or None."""
        token = scan.resume_token
        if not scan.caught_up or token is None or not token_passed(token, offset_token(start)):
            return None
        if self._target is not None:  # availableNow: never beyond the target
            end = self._target if token_passed(token, self._target) else token
            return end if token_passed(end, offset_token(start)) else None
        if now - self._last_advance < self._config.idle_advance_seconds:
            return None
        return token

    def prepareForTriggerAvailableNow(self) -> None:
        """Bound the run by the stream's position now: later events wait for the next run."""
        self._target = self._current_token(None)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[TokenRange]:
        if same_position(start, end) or end.get("idle"):
            return []
        return [TokenRange(start, end)]

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: Spark's checkpoint is the durable record of progress."""

    def stop(self) -> None:
        """Close the driver's stream and client (PySpark 4.3 may end the process instead)."""
        if self._scanner is not None:
            self._scanner.shutdown()
            self._scanner = None

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
        if not isinstance(partition, TokenRange):
            raise TypeError(f"expected a TokenRange partition, not {type(partition).__name__}")
        return read_range(self._config, self._converter, partition)


def read_range(
    config: SourceConfig, converter: EventConverter, partition: TokenRange
) -> Iterator[pa.RecordBatch]:
    """The events of ``partition`` as record batches of at most ``arrow_batch_rows`` rows."""
    end = offset_token(partition.end)
    with config.connect() as client, history_lost_as_error(offset_token(partition.start)):
        stream = watch(
            config.target(client),
            list(config.pipeline),
            **config.watch_options(),
            **offset_watch_option(partition.start),
        )
        with stream:
            pending: list[Any] = []
            for event in _events_until(stream, end):
                pending.append(event)
                if len(pending) >= config.arrow_batch_rows:
                    yield converter.convert(pending)
                    pending = []
            if pending:
                yield converter.convert(pending)


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
        data = token_data(event["_id"])
        if data > end_data:
            return
        yield event
        if data == end_data:
            return
