"""The data source's driver side: read the change stream once, ahead of Spark.

PySpark runs ``latestOffset`` and ``partitions`` in one long-lived driver-side
Python process (the streaming source runner). There, a background thread
reads full change events (raw BSON, so fetching is cheap) after the current
position and converts them to Arrow as they arrive, while Spark runs the
previous batch. ``latestOffset`` then only cuts the buffer (at most
``ReadMaxRows`` events, never past an ``availableNow`` target) and
``partitions`` ships the cut events to the executors inside the partitions,
as compressed Arrow IPC. So every event is read from the server once, and
conversion overlaps Spark's own work.

The buffer is a cache, never the record: an offset range is still a pure
function of its two tokens, and a partition planned without buffered data
(a batch replayed from the checkpoint by a new query run) is read from the
server by the executor (:func:`changestream.spark_adapter.source.read_range`),
which yields the same events.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
import time
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from bson.raw_bson import RawBSONDocument

from ..api import watch
from ..stream import ChangeStream
from .config import SourceConfig
from .convert import Converted, EventConverter, event_token, is_invalidate, raw_bytes
from .errors import ChangeStreamInvalidatedError
from .offsets import offset_watch_option, token_data

__all__ = ["PART_BYTES", "ReadAhead", "Taken", "pack", "unpack"]

PART_BYTES = 768 * 1024
"""Compressed Arrow bytes per partition: Spark warns about tasks over 1000 KiB."""

_SEGMENT_ROWS = 4096
"""Events converted per step by the read-ahead thread (at most ``arrow_batch_rows``)."""

_TRICKLE = 0.02
"""Seconds without a new event after which ``take`` converts the pending events itself."""

_CODEC = next((c for c in ("zstd", "lz4") if pa.Codec.is_available(c)), None)


@dataclasses.dataclass(frozen=True)
class Taken:
    """What one :meth:`ReadAhead.take` cut from the buffer."""

    parts: list[Converted]
    """The events taken, converted (empty: nothing to take)."""
    reached_until: bool
    """Every event up to the ``until`` bound is taken: the batch may end at the bound itself."""
    caught_up: bool
    """The server had nothing more after the buffered events (an empty getMore)."""
    resume_token: Any
    """The postBatchResumeToken of that empty getMore (when ``caught_up``)."""

    @property
    def last(self) -> Any:
        """The token of the last event taken."""
        return self.parts[-1].tokens[-1]


@dataclasses.dataclass(frozen=True)
class _Stopped:
    """Why the read-ahead thread stopped: an invalidate, a closed stream, or an error."""

    token: Any = None
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A range handed to Spark by ``latestOffset``, waiting for ``partitions``."""

    start: dict[str, Any]
    end: dict[str, Any]
    parts: list[Converted]
    packed: list[bytes] | None = None


def _split(converted: Converted, events: int) -> tuple[Converted, Converted]:
    """The first ``events`` events of ``converted`` and the rest (zero-copy slices)."""
    rows = converted.rows_before(events)
    ends = converted.row_ends
    return (
        Converted(
            converted.batch.slice(0, rows),
            converted.tokens[:events],
            None if ends is None else ends[:events],
        ),
        Converted(
            converted.batch.slice(rows),
            converted.tokens[events:],
            None if ends is None else [end - rows for end in ends[events:]],
        ),
    )


def pack(schema: pa.Schema, parts: list[Converted]) -> list[bytes]:
    """Compressed Arrow IPC streams of at most about :data:`PART_BYTES` each (one per partition)."""
    packed: list[bytes] = []
    sink: pa.BufferOutputStream | None = None
    writer: Any = None
    options = pa.ipc.IpcWriteOptions(compression=_CODEC)
    for part in parts:
        if not part.batch.num_rows:
            continue
        if writer is None:
            sink = pa.BufferOutputStream()
            writer = pa.ipc.new_stream(sink, schema, options=options)
        writer.write_batch(part.batch)
        assert sink is not None
        if sink.tell() >= PART_BYTES:
            writer.close()
            packed.append(sink.getvalue().to_pybytes())
            writer = None
    if writer is not None:
        assert sink is not None
        writer.close()
        packed.append(sink.getvalue().to_pybytes())
    return packed


def unpack(data: bytes) -> list[pa.RecordBatch]:
    """The record batches of one :func:`pack` stream."""
    return list(pa.ipc.open_stream(pa.py_buffer(data)))


class ReadAhead:
    """The driver's buffer of converted events after a position (see the module docstring).

    Only the calling thread (Spark's runner) calls the public methods; the
    read-ahead thread only fetches, converts and appends. Capacity: at most
    ``max(prefetch_rows, max_rows_per_batch)`` events or ``prefetch_mb`` of
    Arrow data wait in the buffer.
    """

    def __init__(self, config: SourceConfig, converter: EventConverter) -> None:
        self._config = config
        self._converter = converter
        self._max_rows = max(config.prefetch_rows, config.max_rows_per_batch or 0)
        self._max_bytes = config.prefetch_mb * 1024 * 1024
        self._segment_rows = max(1, min(config.arrow_batch_rows, _SEGMENT_ROWS))
        self._client: Any = None
        self._stream: ChangeStream[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._convert_lock = threading.Lock()
        self._plan: _Plan | None = None
        self._clear(None)

    def _clear(self, head: Any) -> None:
        self._head = head  # offset["token"] right before the first buffered event
        self._segments: collections.deque[Converted] = collections.deque()
        self._buffered = 0  # events in _segments
        self._bytes = 0  # Arrow bytes in _segments
        self._raw: list[bytes | Mapping[str, Any]] = []  # fetched, not converted yet
        self._fetched = 0  # events fetched since the stream opened
        self._mark: tuple[int, Any, float] | None = None  # the last empty getMore: _fetched,
        # its postBatchResumeToken, and when it returned
        self._stopped: _Stopped | None = None
        self._last_fetch = time.monotonic()

    # -- the calling thread --------------------------------------------------------------------
    def take(
        self,
        start: dict[str, Any],
        cap: int | None,
        until: Mapping[str, Any] | None,
        deadline: float,
    ) -> Taken:
        """Cut at most ``cap`` events after offset ``start`` (none after ``until``).

        Waits until ``cap`` events are buffered, the server has nothing more,
        the buffer is full, or ``deadline`` passes. Raises the read-ahead
        thread's error, or :class:`ChangeStreamInvalidatedError`, once every
        event before it was taken.
        """
        since = time.monotonic()
        self._position_at(start)
        until_data = None if until is None else token_data(until)
        while True:
            with self._cond:
                ready = self._ready(cap, until_data, since, time.monotonic() >= deadline)
                convert = bool(self._raw) and (
                    ready
                    or time.monotonic() - self._last_fetch >= _TRICKLE
                    or (cap is not None and self._buffered + len(self._raw) >= cap)
                )
                if ready and not convert:
                    taken = self._cut(cap, until_data)
                    stopped = self._stopped
                    exhausted = not taken.parts and not self._segments and not self._raw
                    break
                if not convert:
                    self._cond.wait(max(0.0, min(deadline - time.monotonic(), _TRICKLE)))
                    continue
            self._convert_pending()
        if stopped is not None and exhausted:  # every event before the stop is taken
            self.close()
            if stopped.error is not None:
                raise stopped.error
            raise ChangeStreamInvalidatedError(stopped.token)
        return taken

    def plan(self, start: dict[str, Any], end: dict[str, Any], taken: Taken) -> None:
        """``latestOffset`` returned ``end`` for ``taken``: the buffer now starts after it."""
        self._head = end["token"]
        self._plan = _Plan(start, end, taken.parts)

    def moved_to(self, offset: dict[str, Any]) -> None:
        """The position is now ``offset`` with nothing taken (an idle advance)."""
        self._head = offset["token"]
        self._plan = None

    def packed(self, start: dict[str, Any], end: dict[str, Any]) -> list[bytes] | None:
        """The events of the range ``latestOffset`` just returned, packed; ``None`` if unknown."""
        plan = self._plan
        if plan is None or plan.start != start or plan.end != end:
            return None
        if plan.packed is None:
            plan = self._plan = dataclasses.replace(
                plan, packed=pack(self._converter.schema, plan.parts), parts=[]
            )
        return plan.packed

    def close(self) -> None:
        """Stop reading and forget the buffer (the client stays for the next stream)."""
        self._stop_thread()
        self._plan = None
        self._clear(None)

    def shutdown(self) -> None:
        """:meth:`close`, and close the client."""
        self.close()
        if self._client is not None:
            self._client.close()
            self._client = None

    def _position_at(self, start: dict[str, Any]) -> None:
        """Make the buffer start right after ``start`` (reopen the stream if it cannot)."""
        token = start["token"]
        if self._stream is not None and self._head == token:
            return
        plan = self._plan
        if (
            self._stream is not None
            and plan is not None
            and plan.packed is None
            and plan.start["token"] == token
            and plan.end["token"] == self._head
        ):  # Spark asks again for a range it did not plan: put it back
            with self._cond:
                for part in reversed(plan.parts):
                    self._segments.appendleft(part)
                    self._buffered += len(part.tokens)
                    self._bytes += part.batch.nbytes
            self._head, self._plan = token, None
            return
        self.close()
        config = self._config
        if self._client is None:
            self._client = config.connect()
        stream = watch(
            config.target(self._client),
            list(config.pipeline),
            **config.watch_options(),
            **offset_watch_option(start),
            document_class=RawBSONDocument,
        )
        self._clear(token)
        self._stream = stream
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(stream, self._stop),
            name="changestream-readahead",
            daemon=True,
        )
        self._thread.start()

    def _stop_thread(self) -> None:
        stream, thread = self._stream, self._thread
        self._stream = self._thread = None
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if stream is not None:
            stream.close()  # waits for a getMore in flight (at most max_await_time_ms)
        if thread is not None:
            thread.join()

    def _ready(self, cap: int | None, until_data: str | None, since: float, late: bool) -> bool:
        """Whether ``take`` may cut now (called with the condition held).

        Caught up means an empty getMore after every fetched event, returned
        after ``since`` (an awaitData getMore returns as soon as an event is
        visible, so one written before ``take`` was called is seen), or one
        whose token reaches ``until`` (nothing before the bound can come).
        """
        if late or self._stopped is not None:
            return True
        if cap is not None and self._buffered >= cap:
            return True
        if self._buffered >= self._max_rows or self._bytes >= self._max_bytes:
            return True
        if (
            until_data is not None
            and self._segments
            and token_data(self._segments[-1].tokens[-1]) > until_data
        ):
            return True  # every event up to the bound is buffered
        mark = self._mark
        if mark is None or mark[0] != self._fetched or self._raw:
            return False
        if until_data is not None and mark[1] is not None and token_data(mark[1]) >= until_data:
            return True
        return mark[2] >= since

    def _cut(self, cap: int | None, until_data: str | None) -> Taken:
        """Take the events (called with the condition held)."""
        want = self._buffered if cap is None else min(cap, self._buffered)
        parts: list[Converted] = []
        reached_until = False
        while want and self._segments:
            segment = self._segments[0]
            count = min(want, len(segment.tokens))
            if until_data is not None and token_data(segment.tokens[count - 1]) > until_data:
                datas = [token_data(t) for t in segment.tokens[:count]]
                count = bisect.bisect_right(datas, until_data)
                reached_until = True
                want = count  # stop after this segment
            if count == len(segment.tokens):
                self._segments.popleft()
                taken = segment
            elif count:
                taken, self._segments[0] = _split(segment, count)
            else:
                break
            parts.append(taken)
            self._buffered -= count
            self._bytes -= taken.batch.nbytes
            want -= count
        mark = self._mark
        caught_up = mark is not None and mark[0] == self._fetched and not self._raw
        if until_data is not None and not self._segments and caught_up:
            assert mark is not None
            reached_until = reached_until or (
                mark[1] is not None and token_data(mark[1]) >= until_data
            )
        self._cond.notify_all()  # room for the read-ahead thread
        return Taken(parts, reached_until and bool(parts), caught_up, mark[1] if mark else None)

    # -- the read-ahead thread -----------------------------------------------------------------
    def _run(self, stream: ChangeStream[Any], stop: threading.Event) -> None:
        cond = self._cond
        try:
            while not stop.is_set():
                with cond:
                    while not stop.is_set() and (
                        self._buffered + len(self._raw) >= self._max_rows
                        or self._bytes >= self._max_bytes
                    ):
                        cond.wait(0.1)  # Spark is behind: read no further
                if stop.is_set():
                    return
                event = stream.try_next()
                if event is None:
                    returned = time.monotonic()
                    self._convert_pending()
                    with cond:
                        self._mark = (self._fetched, stream.resume_token, returned)
                        if not stream.alive:  # closed by an invalidate the pipeline removed
                            self._stopped = self._stopped or _Stopped(stream.resume_token)
                        cond.notify_all()
                    if not stream.alive or self._stopped is not None:
                        return
                    continue
                raw = raw_bytes(event)
                if is_invalidate(raw):
                    self._convert_pending()
                    with cond:
                        self._stopped = self._stopped or _Stopped(event_token(raw))
                        cond.notify_all()
                    return
                with cond:
                    self._raw.append(raw)
                    self._fetched += 1
                    self._last_fetch = time.monotonic()
                    full = len(self._raw) >= self._segment_rows
                if full:
                    self._convert_pending()
                if self._stopped is not None:
                    return
        except BaseException as exc:
            if not stop.is_set():
                with cond:
                    self._stopped = _Stopped(error=exc)
                    cond.notify_all()

    def _convert_pending(self) -> None:
        """Convert the fetched events (either thread; in order, one conversion at a time)."""
        with self._convert_lock:
            with self._cond:
                chunk, self._raw = self._raw, []
            if not chunk:
                return
            try:
                converted = self._converter.convert_events(chunk)
            except (
                Exception
            ) as exc:  # e.g. SchemaMismatchError: fail once the events before it are taken
                with self._cond:
                    self._stopped = _Stopped(error=exc)
                    self._cond.notify_all()
                return
            with self._cond:
                self._segments.append(converted)
                self._buffered += len(converted.tokens)
                self._bytes += converted.batch.nbytes
                self._cond.notify_all()
