"""The data source's driver side: read the change stream once, ahead of Spark.

PySpark runs ``latestOffset`` and ``partitions`` in one long-lived driver-side
Python process (the streaming source runner). There, the adapter's one
prefetcher (:mod:`._prefetch`, as ``foreach_batch`` uses it) reads the events
after the current position as raw BSON while Spark runs the previous batch. ``latestOffset`` then only cuts the buffer (at most
``ReadMaxRows`` events, never past an ``availableNow`` target) and
``partitions`` ships the cut events' bytes, compressed, inside the
partitions (:func:`pack`). The executors turn them into Arrow (in parallel
when a batch spans several partitions). So every event is read from the
server once, the driver does nothing per event but fetch it, and the
conversion runs where Spark has cores.

The buffer is a cache, never the record: an offset range is still a pure
function of its two tokens, and a partition planned without buffered data
(a batch replayed from the checkpoint by a new query run) is read from the
server by the executor (:func:`changestream.spark_adapter._source.read_range`),
which yields the same events.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import struct
import time
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
from bson.raw_bson import RawBSONDocument

from .. import ChangeStream, watch
from ._config import SourceConfig
from ._convert import event_token, raw_event
from ._errors import invalidated
from ._offsets import offset_watch_option, token_data
from ._prefetch import Prefetcher, open_retrying

__all__ = ["PART_BYTES", "ReadAhead", "Taken", "pack", "unpack", "unpack_chunks"]

PART_BYTES = 16 * 1024 * 1024
"""Raw BSON per partition (~30,000 events of 540 B: a few tenths of a second of conversion).
A larger batch becomes several partitions, converted in parallel. Each Python task has a
fixed cost, so fewer, longer tasks are faster: on the 2-core machine 8 MiB partitions took
a 50,000-event batch from ~3.7 s to ~1.9 s against 2 MiB ones, and 16 MiB ones (two
tasks for such a batch, one per core of ``local[2]``, instead of four) cut the CPU of a
``merge_into`` query by about a tenth (``docs/spark.md``, "Throughput")."""
TASK_BYTES = 900 * 1024
"""Compressed bytes per partition at most: a partition that compresses to more is split, so
a task stays under the 1000 KiB task size Spark warns about (change events usually compress
tens of times over, so this binds only for incompressible documents)."""

_CODEC = next((c for c in ("zstd", "lz4") if pa.Codec.is_available(c)), None)
_HEADER = struct.Struct("<BQI")
"""A partition's header: compressed or not, the size of the rest uncompressed, the number of
events. The rest is the events' lengths (``<I`` each), then the events: an executor finds
its chunks' bounds without a Python step per event."""


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
class _Plan:
    """A range handed to Spark by ``latestOffset``, waiting for ``partitions``."""

    start: dict[str, Any]
    end: dict[str, Any]
    events: list[bytes]
    packed: list[bytes] | None = None


def pack(events: list[bytes]) -> list[bytes]:
    """The events in partitions of at most about :data:`PART_BYTES` of BSON, compressed.

    The partitions are about equal in size: their conversions run in parallel,
    and the batch waits for the largest. One that compresses to more than
    :data:`TASK_BYTES` is split in two until it fits (or holds one event).
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
            packed += _compress_fitting(group)
            group, size = [], 0.0
    if group:
        packed += _compress_fitting(group)
    return packed


def _compress_fitting(events: list[bytes]) -> list[bytes]:
    """``events`` compressed as one partition, or as several of at most :data:`TASK_BYTES`."""
    packed = _compress(events)
    if len(packed) <= TASK_BYTES or len(events) == 1:
        return [packed]
    half = len(events) // 2
    return _compress_fitting(events[:half]) + _compress_fitting(events[half:])


def _compress(events: list[bytes]) -> bytes:
    data = struct.pack(f"<{len(events)}I", *map(len, events)) + b"".join(events)
    if _CODEC is None:
        return _HEADER.pack(0, len(data), len(events)) + data
    compressed: bytes = pa.Codec(_CODEC).compress(data, asbytes=True)
    return _HEADER.pack(1, len(data), len(events)) + compressed


def _bounds(data: bytes) -> tuple[bytes, list[int]]:
    """A partition's events back to back, and where each starts (and the last ends)."""
    compressed, size, count = _HEADER.unpack_from(data)
    if compressed:
        if _CODEC is None:
            raise RuntimeError("this partition is compressed, but pyarrow here has no zstd or lz4")
        raw = pa.Codec(_CODEC).decompress(
            data[_HEADER.size :], decompressed_size=size, asbytes=True
        )
    else:
        raw = data[_HEADER.size :]
    lengths = struct.unpack_from(f"<{count}I", raw)
    return raw, list(itertools.accumulate(lengths, initial=4 * count))


def unpack(data: bytes) -> list[bytes]:
    """The events of one :func:`pack` partition, as raw BSON documents."""
    raw, starts = _bounds(data)
    return [raw[a:b] for a, b in itertools.pairwise(starts)]


def unpack_chunks(data: bytes, size: int) -> list[bytes]:
    """The events of one :func:`pack` partition, ``size`` at a time, each group as one
    ``bytes`` of BSON documents back to back (what ``bson.decode_all`` reads)."""
    raw, starts = _bounds(data)
    edges = starts[::size]
    if edges[-1] != starts[-1]:
        edges.append(starts[-1])
    return [raw[a:b] for a, b in itertools.pairwise(edges)]


def _data(event: bytes) -> str:
    """The ``_data`` of an event's token (the key that orders tokens)."""
    return token_data(event_token(event))


class ReadAhead:
    """The driver's buffer of raw events after a position (see the module docstring).

    Only the calling thread (Spark's runner) calls the public methods; a
    :class:`~changestream.spark_adapter._prefetch.Prefetcher` fetches. Capacity:
    at most ``max(prefetch_rows, max_rows_per_batch)`` events or
    ``prefetch_mb`` of BSON wait in the buffer.
    """

    def __init__(self, config: SourceConfig) -> None:
        self._config = config
        self._max_rows = max(config.prefetch_rows, config.max_rows_per_batch or 0)
        self._max_bytes = config.prefetch_mb * 1024 * 1024
        self._client: Any = None
        self._fetch: Prefetcher | None = None
        self._plan: _Plan | None = None
        self._head: Any = None  # offset["token"] right before the first buffered event

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
        the buffer is full, or ``deadline`` passes. Raises the prefetcher's
        error, or :class:`~changestream.errors.StreamInvalidatedError`, once every
        event before it was taken.
        """
        since = time.monotonic()
        fetch = self._position_at(start)
        until_data = None if until is None else token_data(until)
        fetch.wait(
            lambda: self._ready(fetch, cap, until_data, since, time.monotonic() >= deadline),
            max(0.0, deadline - time.monotonic()),
        )
        with fetch.cond:
            taken = self._cut(fetch, cap, until_data)
            stopped = fetch.stopped
        fetch.taken(sum(map(len, taken.events)))  # room for the fetch thread
        if stopped is not None and not taken.events and not fetch.events:
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
        fetch, self._fetch = self._fetch, None
        if fetch is not None:
            fetch.stop(close_stream=True)
        self._plan = None
        self._head = None

    def shutdown(self) -> None:
        """:meth:`close`, and close the client."""
        self.close()
        if self._client is not None:
            self._client.close()
            self._client = None

    def _position_at(self, start: dict[str, Any]) -> Prefetcher:
        """The prefetcher whose buffer starts right after ``start`` (reopened if need be)."""
        token = start["token"]
        fetch = self._fetch
        if fetch is not None and self._head == token:
            return fetch
        plan = self._plan
        if (
            fetch is not None
            and plan is not None
            and plan.packed is None
            and plan.start["token"] == token
            and plan.end["token"] == self._head
        ):  # Spark asks again for a range it did not plan: put it back
            fetch.events.extendleft(reversed(plan.events))
            fetch.out_bytes -= sum(map(len, plan.events))
            self._head, self._plan = token, None
            return fetch
        self.close()
        if self._client is None:
            self._client = self._config.connect()
        position = offset_watch_option(start)
        stream = open_retrying(lambda: self._open(position))
        fetch = self._fetch = Prefetcher(
            stream,
            lambda after: self._open({} if after is None else {"start_after": after}),
            raw_event,
            max_rows=self._max_rows,
            max_bytes=self._max_bytes,
        )
        self._head = token
        fetch.start()
        return fetch

    def _open(self, position: Mapping[str, Any]) -> ChangeStream[Any]:
        config = self._config
        return watch(
            config.target(self._client),
            list(config.pipeline),
            **config.watch_options(),
            **position,
            document_class=RawBSONDocument,
        )

    @staticmethod
    def _ready(
        fetch: Prefetcher, cap: int | None, until_data: str | None, since: float, late: bool
    ) -> bool:
        """Whether ``take`` may cut now (called with the condition held).

        Caught up means an empty getMore after every fetched event, returned
        after ``since`` (an awaitData getMore returns as soon as an event is
        visible, so one written before ``take`` was called is seen), or one
        whose token reaches ``until`` (nothing before the bound can come).
        """
        if late or fetch.stopped is not None or fetch.full():
            return True
        events = fetch.events
        if cap is not None and len(events) >= cap:
            return True
        if until_data is not None and events and _data(events[-1]) > until_data:
            return True  # every event up to the bound is buffered
        mark = fetch.mark
        if mark is None or mark[0] != fetch.fetched:
            return False
        if until_data is not None and mark[1] is not None and token_data(mark[1]) >= until_data:
            return True
        return mark[2] >= since

    @staticmethod
    def _cut(fetch: Prefetcher, cap: int | None, until_data: str | None) -> Taken:
        """Take the events (called with the condition held)."""
        events = fetch.events
        count = len(events) if cap is None else min(cap, len(events))
        reached_until = False
        if until_data is not None and count and _data(events[count - 1]) > until_data:
            datas = [_data(event) for event in itertools.islice(events, count)]
            count = bisect.bisect_right(datas, until_data)
            reached_until = True
        taken = [events.popleft() for _ in range(count)]
        mark = fetch.mark
        caught_up = mark is not None and mark[0] == fetch.fetched and not events
        if until_data is not None and caught_up:
            assert mark is not None
            reached_until = reached_until or (
                mark[1] is not None and token_data(mark[1]) >= until_data
            )
        return Taken(taken, reached_until and bool(taken), caught_up, mark[1] if mark else None)
