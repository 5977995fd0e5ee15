"""The data source's driver side: read the change stream once, ahead of Spark.

PySpark runs ``latestOffset`` and ``partitions`` in one long-lived driver-side
Python process (the streaming source runner). There, a background thread
reads the events after the current position as raw BSON while Spark runs the
previous batch. ``latestOffset`` then only cuts the buffer (at most
``ReadMaxRows`` events, never past an ``availableNow`` target) and
``partitions`` ships the cut events' bytes, compressed, inside the
partitions (:func:`pack`). The executors turn them into Arrow (in parallel
when a batch spans several partitions). So every event is read from the
server once, the driver does nothing per event but fetch it, and the
conversion runs where Spark has cores.

The buffer is a cache, never the record: an offset range is still a pure
function of its two tokens, and a partition planned without buffered data
(a batch replayed from the checkpoint by a new query run) is read from the
server by the executor (:func:`changestream.spark_adapter.source.read_range`),
which yields the same events.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import pyarrow as pa
import tenacity
from bson.raw_bson import RawBSONDocument
from pymongo.errors import PyMongoError

from .. import ChangeStream, watch
from .._consume import RetryPolicy, is_transient, stalled
from ..errors import RetriesExhaustedError, describe_error
from ._config import SourceConfig
from ._convert import event_token, is_invalidate, raw_event
from ._errors import invalidated
from ._offsets import offset_watch_option, token_data

__all__ = ["PART_BYTES", "ReadAhead", "Taken", "pack", "unpack"]

PART_BYTES = 2 * 1024 * 1024
"""Raw BSON per partition. Compressed (change events compress several times over) a
partition stays under the 1000 KiB task size Spark warns about; a larger batch becomes
several partitions, converted in parallel."""

_POLL = 0.01
"""Seconds between the checks of ``take`` while it waits for events."""
RETRY = RetryPolicy(retry_for=300.0, backoff_initial=0.5, backoff_max=30.0)
"""How the read-ahead reopens its stream after transient failures (consume's defaults):
exponential backoff, and :class:`~changestream.errors.RetriesExhaustedError` after
300 s without progress. Each wait is logged by the core's one retry logger (the policy's
``before_sleep``, logger ``changestream.consume``)."""
log = logging.getLogger("changestream.spark")
T = TypeVar("T")

_CODEC = next((c for c in ("zstd", "lz4") if pa.Codec.is_available(c)), None)
_HEADER = 9  # one byte: compressed or not; eight: the raw size


def open_retrying(open_stream: Callable[[], T]) -> T:
    """``open_stream()``, retried after transient failures as the read-ahead's reopens are.

    A network error or a failover during the opening aggregate (which the
    stream retries once itself) backs off and tries again (:data:`RETRY`),
    instead of failing the query or the ``foreach_batch`` run; after
    ``retry_for`` seconds the last error propagates.
    """
    return tenacity.Retrying(**RETRY.arguments())(open_stream)


@dataclasses.dataclass(frozen=True)
class Taken:
    """What one :meth:`ReadAhead.take` cut from the buffer."""

    events: list[bytes]
    """The events taken, as raw BSON, in stream order (empty: nothing to take)."""
    reached_until: bool
    """Every event up to the ``until`` bound is taken: the batch may end at the bound itself."""
    caught_up: bool
    """The server had nothing more after the buffered events (an empty getMore)."""
    resume_token: Any
    """The postBatchResumeToken of that empty getMore (when ``caught_up``)."""

    @property
    def last(self) -> Any:
        """The token of the last event taken."""
        return event_token(self.events[-1])


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
    events: list[bytes]
    packed: list[bytes] | None = None


def pack(events: list[bytes]) -> list[bytes]:
    """The events in partitions of at most about :data:`PART_BYTES` of BSON, compressed.

    The partitions are about equal in size: their conversions run in parallel,
    and the batch waits for the largest.
    """
    total = sum(map(len, events))
    if not total:
        return []
    share = total / -(-total // PART_BYTES)  # ceil: the fewest partitions that fit
    packed: list[bytes] = []
    group: list[bytes] = []
    size = 0.0
    for event in events:
        group.append(event)
        size += len(event)
        if size >= share:
            packed.append(_compress(b"".join(group)))
            group, size = [], 0.0
    if group:
        packed.append(_compress(b"".join(group)))
    return packed


def _compress(data: bytes) -> bytes:
    header = len(data).to_bytes(8, "little")
    if _CODEC is None:
        return b"\x00" + header + data
    compressed: bytes = pa.Codec(_CODEC).compress(data, asbytes=True)
    return b"\x01" + header + compressed


def unpack(data: bytes) -> list[bytes]:
    """The events of one :func:`pack` partition, as raw BSON documents."""
    size = int.from_bytes(data[1:_HEADER], "little")
    if data[0]:
        if _CODEC is None:
            raise RuntimeError("this partition is compressed, but pyarrow here has no zstd or lz4")
        raw = pa.Codec(_CODEC).decompress(data[_HEADER:], decompressed_size=size, asbytes=True)
    else:
        raw = data[_HEADER:]
    events: list[bytes] = []
    position = 0
    while position < size:
        length = int.from_bytes(raw[position : position + 4], "little")
        events.append(raw[position : position + length])
        position += length
    return events


def _data(event: bytes) -> str:
    """The ``_data`` of an event's token (the key that orders tokens)."""
    return token_data(event_token(event))


class ReadAhead:
    """The driver's buffer of raw events after a position (see the module docstring).

    Only the calling thread (Spark's runner) calls the public methods; the
    read-ahead thread only fetches and appends (a deque: no lock per event).
    Capacity: at most ``max(prefetch_rows, max_rows_per_batch)`` events or
    ``prefetch_mb`` of BSON wait in the buffer.
    """

    def __init__(self, config: SourceConfig) -> None:
        self._config = config
        self._max_rows = max(config.prefetch_rows, config.max_rows_per_batch or 0)
        self._max_bytes = config.prefetch_mb * 1024 * 1024
        self._client: Any = None
        self._stream: ChangeStream[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._plan: _Plan | None = None
        self._clear(None)

    def _clear(self, head: Any) -> None:
        self._head = head  # offset["token"] right before the first buffered event
        self._events: collections.deque[bytes] = collections.deque()
        self._in_bytes = 0  # BSON appended (written by the read-ahead thread only)
        self._out_bytes = 0  # BSON taken (written by the calling thread only)
        self._fetched = 0  # events fetched since the stream opened (read-ahead thread only)
        self._mark: tuple[int, Any, float] | None = None  # the last empty getMore: _fetched,
        # its postBatchResumeToken, and when it returned
        self._stopped: _Stopped | None = None

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
        thread's error, or :class:`~changestream.errors.StreamInvalidatedError`, once every
        event before it was taken.
        """
        since = time.monotonic()
        self._position_at(start)
        until_data = None if until is None else token_data(until)
        with self._cond:
            while not self._ready(cap, until_data, since, time.monotonic() >= deadline):
                self._cond.wait(max(0.0, min(deadline - time.monotonic(), _POLL)))
            taken = self._cut(cap, until_data)
            stopped = self._stopped
            self._cond.notify_all()  # room for the read-ahead thread
        if stopped is not None and not taken.events and not self._events:
            self.close()  # every event before the stop is taken
            if stopped.error is not None:
                raise stopped.error
            raise invalidated(stopped.token)
        return taken

    def plan(self, start: dict[str, Any], end: dict[str, Any], taken: Taken) -> None:
        """``latestOffset`` returned ``end`` for ``taken``: the buffer now starts after it."""
        self._head = end["token"]
        self._plan = _Plan(start, end, taken.events)

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
            plan = self._plan = dataclasses.replace(plan, packed=pack(plan.events), events=[])
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
            self._events.extendleft(reversed(plan.events))
            self._out_bytes -= sum(map(len, plan.events))
            self._head, self._plan = token, None
            return
        self.close()
        config = self._config
        if self._client is None:
            self._client = config.connect()
        position = offset_watch_option(start)
        stream = open_retrying(lambda: self._open(position))
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

    def _open(self, position: Mapping[str, Any]) -> ChangeStream[Any]:
        config = self._config
        return watch(
            config.target(self._client),
            list(config.pipeline),
            **config.watch_options(),
            **position,
            document_class=RawBSONDocument,
        )

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

    def _full(self) -> bool:
        return (
            len(self._events) >= self._max_rows
            or self._in_bytes - self._out_bytes >= self._max_bytes
        )

    def _ready(self, cap: int | None, until_data: str | None, since: float, late: bool) -> bool:
        """Whether ``take`` may cut now (called with the condition held).

        Caught up means an empty getMore after every fetched event, returned
        after ``since`` (an awaitData getMore returns as soon as an event is
        visible, so one written before ``take`` was called is seen), or one
        whose token reaches ``until`` (nothing before the bound can come).
        """
        if late or self._stopped is not None or self._full():
            return True
        events = self._events
        if cap is not None and len(events) >= cap:
            return True
        if until_data is not None and events and _data(events[-1]) > until_data:
            return True  # every event up to the bound is buffered
        mark = self._mark
        if mark is None or mark[0] != self._fetched:
            return False
        if until_data is not None and mark[1] is not None and token_data(mark[1]) >= until_data:
            return True
        return mark[2] >= since

    def _cut(self, cap: int | None, until_data: str | None) -> Taken:
        """Take the events (called with the condition held)."""
        events = self._events
        count = len(events) if cap is None else min(cap, len(events))
        reached_until = False
        if until_data is not None and count and _data(events[count - 1]) > until_data:
            datas = [_data(event) for event in itertools.islice(events, count)]
            count = bisect.bisect_right(datas, until_data)
            reached_until = True
        taken = [events.popleft() for _ in range(count)]
        self._out_bytes += sum(map(len, taken))
        mark = self._mark
        caught_up = mark is not None and mark[0] == self._fetched and not events
        if until_data is not None and caught_up:
            assert mark is not None
            reached_until = reached_until or (
                mark[1] is not None and token_data(mark[1]) >= until_data
            )
        return Taken(taken, reached_until and bool(taken), caught_up, mark[1] if mark else None)

    # -- the read-ahead thread -----------------------------------------------------------------
    def _run(self, stream: ChangeStream[Any], stop: threading.Event) -> None:
        """Read ahead; after a transient failure reopen from the last fetched event, backing off.

        The stream's own single resume covers a failover; when it fails (or
        resumes bring nothing, see ``MAX_IDLE_RESUMES``) the stream is reopened
        from its token with exponential backoff (:data:`RETRY`), and after
        ``retry_for`` seconds without progress :class:`RetriesExhaustedError`
        names the repeated failure. Other errors stop the read-ahead at once.
        """
        current: list[ChangeStream[Any] | None] = [stream]
        resume_from: list[Any] = [None]

        def session() -> bool:
            """Read until stopped; ``True``: failed transiently after progress (fresh budget)."""
            reading = current[0]
            if reading is None:
                token = resume_from[0]
                reading = self._open({} if token is None else {"start_after": token})
                current[0] = reading
            progress = [False]
            try:
                self._read(reading, stop, progress)
                if reading is not stream:  # a reopened stream is this thread's to close
                    reading.close()
            except Exception as exc:
                current[0] = None
                resume_from[0] = reading.resume_token
                with contextlib.suppress(PyMongoError):
                    reading.close()
                if progress[0] and is_transient(exc) and not stop.is_set():
                    log.warning("change stream read-ahead failed (%s); reopening",
                                describe_error(exc))
                    return True
                raise
            return False

        def sleep(seconds: float) -> None:
            stop.wait(seconds)

        try:
            while not stop.is_set() and tenacity.Retrying(sleep=sleep, **RETRY.arguments())(
                session
            ):
                pass
        except BaseException as exc:
            if not stop.is_set():
                error: BaseException = exc
                if is_transient(exc):
                    error = RetriesExhaustedError(
                        f"the change stream read-ahead kept failing for {RETRY.retry_for:g} s, "
                        f"the last time with {describe_error(exc)}; the query's checkpoint "
                        "still holds its position: restart the query once the deployment "
                        "is reachable",
                        token=resume_from[0],
                    )
                    error.__cause__ = exc
                with self._cond:
                    self._stopped = _Stopped(error=error)
                    self._cond.notify_all()

    def _read(
        self, stream: ChangeStream[Any], stop: threading.Event, progress: list[bool]
    ) -> None:
        """Fetch into the buffer until stopped or the stream ends; ``progress[0]``: it moved."""
        cond, events = self._cond, self._events
        while not stop.is_set():
            if self._full():  # Spark is behind: read no further
                with cond:
                    while not stop.is_set() and self._full():
                        cond.wait(0.1)
                continue
            event = stream.try_next()
            if event is None:
                progress[0] = progress[0] or not stalled(stream)
                with cond:
                    self._mark = (self._fetched, stream.resume_token, time.monotonic())
                    if not stream.alive:  # closed by an invalidate the pipeline removed
                        self._stopped = self._stopped or _Stopped(stream.resume_token)
                    cond.notify_all()
                if self._stopped is not None:
                    return
                continue
            raw = raw_event(event)
            if is_invalidate(raw):
                with cond:
                    self._stopped = self._stopped or _Stopped(event_token(raw))
                    cond.notify_all()
                return
            self._fetched += 1  # before the append: a mark never looks newer than it is
            self._in_bytes += len(raw)
            events.append(raw)
            progress[0] = True
