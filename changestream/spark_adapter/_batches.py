"""``foreach_batch``: feed a change stream to ``func(DataFrame, batch_id)`` in micro-batches.

Three threads form a pipeline, so fetching, converting and Spark's work
overlap: a fetch thread polls the stream with ``try_next`` (the adapter's
one :class:`~._prefetch.Prefetcher`, also the data source's); a cutter thread
cuts a batch when it holds ``max_rows`` events or its first event is
``max_seconds`` old and converts it to Arrow (incrementally, as events
arrive); the calling thread turns each finished table into a DataFrame,
calls ``func`` and only then saves (resume token, batch id) in the token
store. After a crash the stream reopens from the stored token and the batch
id continues, so a ``func`` that *replaces* its output for a batch id gives
exactly-once results: the re-run batch may hold more or fewer events than
the lost attempt (batches are cut by time), but it starts at the same event
and its output replaces the old.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import DataType, StructType

from .. import ChangeStream, token_cluster_time, watch
from .._token import ResumeToken
from ..stores import TokenStore
from ._config import splits_events
from ._convert import EventConverter, event_token, raw_bytes
from ._errors import history_lost_as_error
from ._prefetch import Prefetcher, open_retrying
from ._schema import event_ddl

__all__ = ["BatchRunResult", "foreach_batch", "stream_opener"]

_START_OPTIONS = ("resume_after", "start_after", "start_at_operation_time")

StreamOpener = Callable[[Mapping[str, Any] | None], ChangeStream[Any]]


def stream_opener(
    target: Any, pipeline: list[Mapping[str, Any]] | None = None, **options: Any
) -> StreamOpener:
    """An ``open_stream`` for :func:`foreach_batch`: ``watch(target, pipeline, **options)``.

    With a stored token the stream continues with ``start_after`` (which also
    accepts an ``invalidate`` token) and the start options in ``options`` are
    ignored; ``max_await_time_ms`` defaults to 200 so time cuts stay prompt.
    A pipeline ending with ``$changeStreamSplitLargeEvent`` gets
    ``reassemble_split_events=True`` unless given: events over 16 MiB arrive
    whole. Without ``document_class``, ``codec_options`` or ``typed`` the events
    stay raw BSON (``RawBSONDocument``) until the batch is converted:
    cheaper to fetch and lighter on the garbage collector.
    """
    options.setdefault("max_await_time_ms", 200)
    if splits_events(pipeline):
        options.setdefault("reassemble_split_events", True)  # one row per event
    if not {"document_class", "codec_options", "typed"} & options.keys():
        options["document_class"] = RawBSONDocument

    def open_stream(token: Mapping[str, Any] | None) -> ChangeStream[Any]:
        if token is None:
            return watch(target, pipeline, **options)
        kept = {key: value for key, value in options.items() if key not in _START_OPTIONS}
        return watch(target, pipeline, start_after=token, **kept)

    return open_stream


@dataclasses.dataclass(frozen=True)
class BatchRunResult:
    """How a :func:`foreach_batch` run ended."""

    batches: int
    """Calls of ``func`` made by this run."""
    rows: int
    """Rows passed to ``func`` by this run."""
    last_batch_id: int | None
    """The id of the last batch delivered (by this or an earlier run), if any."""
    resume_token: dict[str, Any] | None
    """The token stored last."""
    reason: str
    """``"idle"`` (``until_idle``: caught up with the call), ``"max_batches"``, ``"stopped"`` (``stop_event``) or
    ``"invalidated"`` (the stream was invalidated; its token is stored, so the next
    run continues after it)."""


def foreach_batch(
    spark: SparkSession,
    open_stream: StreamOpener,
    func: Callable[[DataFrame, int], object],
    store: TokenStore,
    *,
    max_rows: int = 10_000,
    max_seconds: float = 1.0,
    idle_seconds: float = 60.0,
    full_document_schema: str | None = None,
    publish_full_document_only: bool = False,
    until_idle: bool = False,
    max_batches: int | None = None,
    stop_event: threading.Event | None = None,
) -> BatchRunResult:
    """Run ``func(df, batch_id)`` on micro-batches of a change stream until told to stop.

    ``open_stream(token)`` opens the stream after ``token`` (``None``: the
    first run; see :func:`stream_opener`). Batches hold at most ``max_rows``
    events and are cut ``max_seconds`` after their first event; ``df`` has
    the schema of :func:`changestream.spark_adapter.event_ddl` (for the same
    ``full_document_schema`` / ``publish_full_document_only``); a ``func``
    that has an ``arrow_batch(table, batch_id)`` method (:func:`stage_into`'s)
    is given the batch's ``pyarrow.Table`` of those columns there instead,
    skipping the DataFrame. Batches without rows are not passed to ``func``. Once no event has come for
    ``idle_seconds``, the stream's postBatchResumeToken is stored (and again
    every ``idle_seconds`` while it stays idle) so a restart stays inside the
    oplog window. With ``until_idle`` the run ends at the first empty getMore
    whose postBatchResumeToken has reached the cluster time of the call (the
    newest in the reply to the opening aggregate): every event written before
    the call is delivered, also those a mongos holds back until its idle
    shards' periodic no-ops (10 s apart by default) let it release them (a
    first run, without a stored token, also waits for the stream to move past
    its start); ``idle_seconds`` plays no part in it. Stops then, after ``max_batches``
    calls, when ``stop_event`` is set (after the
    batches already cut), or after an ``invalidate``. Opening the stream, and
    reopening it after the last event read when it fails later, retries
    transient failures (a network error, a failover) with backoff for up to
    300 s. Other exceptions from ``func`` or the stream propagate;
    nothing is stored for the failed batch.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, not {max_rows}")
    if max_seconds < 0 or idle_seconds < 0:
        raise ValueError("max_seconds and idle_seconds must be >= 0")
    ddl = event_ddl(full_document_schema, publish_full_document_only=publish_full_document_only)
    spark_schema = DataType.fromDDL(ddl)
    assert isinstance(spark_schema, StructType)
    converter = EventConverter(
        to_arrow_schema(spark_schema, timezone="UTC"),
        publish_full_document_only=publish_full_document_only,
    )
    # A func with an ``arrow_batch(table, batch_id)`` method (``stage_into``'s) takes the
    # batch as it is built, Arrow: no round trip through the JVM to a DataFrame and back.
    arrow_batch = getattr(func, "arrow_batch", None)
    run = _Run(store)
    with history_lost_as_error(run.token), open_retrying(lambda: open_stream(run.token)) as stream:
        start = stream.resume_token if run.token is None else None
        if start is not None:
            run.save(start)  # pin the start: a crash must not move it to "now"
        cuts = _Cuts(
            max_rows=max_rows,
            max_seconds=max_seconds,
            idle_seconds=idle_seconds,
            until_idle=until_idle,
            stop_event=stop_event,
            # the cluster time of the call: the newest in the reply to the opening aggregate
            # (through mongos, at least that of every write acknowledged before it)
            called_at=stream.position.server_time,
            start=start,
        )
        pinned = run.token

        def reopen(after: Any) -> ChangeStream[Any]:
            """After a transient failure: right after the last event fetched."""
            return open_stream(after if after is not None else pinned)

        with _Cutter(stream, reopen, converter, cuts) as cutter:
            while True:
                item = cutter.get()
                if isinstance(item, _Batch):
                    if item.table.num_rows:
                        run.batch_id = (run.batch_id if run.batch_id is not None else -1) + 1
                        if arrow_batch is not None:
                            arrow_batch(item.table, run.batch_id)
                        else:
                            func(spark.createDataFrame(item.table, schema=spark_schema),
                                 run.batch_id)
                        run.batches += 1
                        run.rows += item.table.num_rows
                    run.save(item.token)
                    if max_batches is not None and run.batches >= max_batches:
                        reason = "max_batches"
                        break
                elif isinstance(item, _Save):
                    run.save_if_moved(item.token)
                else:
                    if item.token is not None:
                        run.save(item.token)
                    reason = item.reason
                    break
    return BatchRunResult(run.batches, run.rows, run.batch_id, run.token, reason)


_TICK = 0.1
"""Longest wait for the next event when no batch is open (bounds ``stop_event`` latency)."""

_CONVERT_EVERY = 2048
"""Events converted per step while a batch is open (one Arrow record batch each)."""

_BUFFER_BYTES = 64 * 1024 * 1024
"""Most BSON fetched ahead of the cutter (and at most ``max_rows`` events)."""


@dataclasses.dataclass(frozen=True)
class _Failed:
    """A pipeline thread raised; the consumer re-raises the exception."""

    error: BaseException


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A finished batch: its rows and the token of its last event (saved after ``func``)."""

    table: pa.Table
    token: Any


@dataclasses.dataclass(frozen=True)
class _Save:
    """Store this token if it moved (an idle stream's postBatchResumeToken)."""

    token: Any


@dataclasses.dataclass(frozen=True)
class _End:
    """The run ends for ``reason``, after storing ``token`` (if any)."""

    reason: str
    token: Any = None


@dataclasses.dataclass(frozen=True)
class _Cuts:
    """When the cutter ends a batch, stores an idle token, or ends the run."""

    max_rows: int
    max_seconds: float
    idle_seconds: float
    until_idle: bool
    stop_event: threading.Event | None
    called_at: Timestamp | None = None
    """``until_idle`` ends at an empty getMore whose postBatchResumeToken has reached this
    cluster time (``None``: at the first empty getMore)."""
    start: Any = None
    """A new stream's first postBatchResumeToken: a high-water mark one tick *past* the
    cluster time the server had read (events at its own time are still to come), unlike the
    marks of a scan, which are at or behind it. It never ends an ``until_idle`` run: stored as
    the run's idle position, a write made at exactly that time and acknowledged before the
    next call would look delivered to that call's first empty getMore."""

    def caught_up(self, token: Any) -> bool:
        """Whether ``token`` is at or past the cluster time of the call: no event written
        before the call can come after it."""
        if token is not None and self.start is not None and (
            ResumeToken.maybe(token) == ResumeToken.maybe(self.start)
        ):
            return False
        if self.called_at is None:
            return True
        at = token_cluster_time(token) if token is not None else None
        return at is not None and (at.time, at.inc) >= (self.called_at.time, self.called_at.inc)


class _Cutter:
    """Cuts batches and converts them to Arrow on a background thread, ahead of ``func``.

    It runs the adapter's one prefetcher (:class:`~._prefetch.Prefetcher`) and
    hands the calling thread, in stream order, :class:`_Batch`, :class:`_Save`,
    a final :class:`_End` or a :class:`_Failed`. At most one finished batch
    waits, so memory stays bounded and a slow ``func`` slows the fetching
    down. Events are converted :data:`_CONVERT_EVERY` at a time as they
    arrive, so a cut only converts the rest.
    """

    def __init__(
        self,
        stream: ChangeStream[Any],
        reopen: Callable[[Any], ChangeStream[Any]],
        converter: EventConverter,
        cuts: _Cuts,
    ) -> None:
        self._stream = stream
        self._reopen = reopen
        self._converter = converter
        self._cuts = cuts
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="changestream-cutter", daemon=True)

    def __enter__(self) -> _Cutter:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._closing.set()
        self._thread.join()

    def get(self) -> _Batch | _Save | _End:
        """The next item for the calling thread (re-raises the pipeline's exception)."""
        item = self._ready.get()
        if isinstance(item, _Failed):
            raise item.error
        return item  # type: ignore[no-any-return]

    def _emit(self, item: object) -> bool:
        """Hand ``item`` over; False when the calling thread has gone."""
        while not self._closing.is_set():
            try:
                self._ready.put(item, timeout=_TICK)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            with Prefetcher(
                self._stream, self._reopen, raw_bytes,
                max_rows=self._cuts.max_rows, max_bytes=_BUFFER_BYTES,
            ) as fetch:
                end = self._cut(fetch)
            self._emit(end)
        except BaseException as exc:
            self._emit(_Failed(exc))

    def _cut(self, fetch: Prefetcher) -> _End:
        cuts, converter = self._cuts, self._converter
        max_rows, max_seconds = cuts.max_rows, cuts.max_seconds
        events = fetch.events
        chunk: list[Any] = []  # events of the open batch not converted yet
        converted: list[pa.RecordBatch] = []
        pending = 0  # events in the open batch
        last: Any = None  # the open batch's last event
        first_at = 0.0
        emitted_at = time.monotonic()
        consumed = 0  # events taken from the prefetcher
        handled: Any = None  # the last empty-getMore mark acted on

        def flush() -> None:
            nonlocal chunk, converted, pending, emitted_at
            if chunk:
                converted.append(converter.convert(chunk))
            table = pa.Table.from_batches(converted, schema=converter.schema)
            chunk, converted, pending = [], [], 0
            self._emit(_Batch(table, event_token(last)))
            emitted_at = time.monotonic()

        def news() -> bool:
            mark = fetch.mark
            return bool(events) or fetch.stopped is not None or (
                mark is not handled and mark is not None and mark[0] == consumed
            )

        while not self._closing.is_set():
            if cuts.stop_event is not None and cuts.stop_event.is_set():
                if pending:
                    flush()
                return _End("stopped")
            wait = first_at + max_seconds - time.monotonic() if pending else _TICK
            if not fetch.wait(news, max(wait, 0.0)):
                if pending and time.monotonic() - first_at >= max_seconds:
                    flush()
                continue
            now = time.monotonic()
            size = 0
            while events:
                event = events.popleft()
                consumed += 1
                if event.__class__ is bytes:
                    size += len(event)
                if not pending:
                    first_at = now
                chunk.append(event)
                pending += 1
                last = event
                if len(chunk) >= _CONVERT_EVERY:
                    converted.append(converter.convert(chunk))
                    chunk = []
                if pending >= max_rows:
                    flush()
                    now = time.monotonic()
            fetch.taken(size)
            mark = fetch.mark
            if mark is not handled and mark is not None and mark[0] == consumed:
                handled = mark  # an empty getMore after every event taken: the stream is idle
                done = cuts.until_idle and cuts.caught_up(mark[1])
                if pending and (done or now - first_at >= max_seconds):
                    flush()
                    now = time.monotonic()
                if not pending and (done or now - emitted_at >= cuts.idle_seconds):
                    self._emit(_Save(mark[1]))  # past every event delivered
                    emitted_at = now
                    if done:
                        return _End("idle")
            stopped = fetch.stopped
            if stopped is not None and not events and consumed == fetch.fetched:
                if stopped.error is not None:
                    raise stopped.error
                if pending:
                    flush()
                return _End("invalidated", stopped.token)  # stored: the next run continues
            if pending and time.monotonic() - first_at >= max_seconds:
                flush()
        return _End("closed")


class _Run:
    """Progress of one run and its writes to the token store."""

    def __init__(self, store: TokenStore) -> None:
        self.store = store
        stored = store.load()
        self.token: dict[str, Any] | None = dict(stored.token) if stored else None
        self.batch_id: int | None = stored.batch_id if stored else None
        self.batches = 0
        self.rows = 0
        self.saved_at = time.monotonic()

    def save(self, token: Mapping[str, Any]) -> None:
        plain = ResumeToken.of(token).document()
        self.store.save(plain, batch_id=self.batch_id)
        self.token = plain
        self.saved_at = time.monotonic()

    def save_if_moved(self, token: Mapping[str, Any] | None) -> None:
        if token is not None and ResumeToken.maybe(token) != ResumeToken.maybe(self.token):
            self.save(token)
        else:
            self.saved_at = time.monotonic()
