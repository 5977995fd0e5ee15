"""``snapshot_then_watch``: the shell over :class:`changestream._snapshot.SnapshotRun`.

It runs the commands the run asks for (in one session, each getMore on the
server that opened its cursor, so getMores find it), hands out its records, then opens ``watch`` where the run says
and hands out the stream's changes. All decisions are the run's.

This asyncio module is the one source of both shells: ``tools/gen_sync.py``
writes ``changestream/_sync/_snapshot_watch.py`` from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from bson.raw_bson import RawBSONDocument
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import OperationFailure

from .._consumer.options import OVERSIZE_CHOICES, STARTS, opener_arguments_error
from .._pymongo import AsyncCursorReader
from .._read_ahead import READ_AHEAD_BATCH
from .._snapshot import (
    DEFAULT_COPY_BATCH,
    DeliverRecord,
    RunCommand,
    SnapshotRun,
    check_watch_options,
    opens_snapshot,
)
from .._stream_view import StreamView
from ._api import unwrap, watch
from ._stream import AsyncChangeStream

__all__ = ["AsyncSnapshotThenWatch", "snapshot_then_watch"]


async def snapshot_then_watch(
    target: Any,
    pipeline: list[Mapping[str, Any]] | None = None,
    *,
    resume_after: Mapping[str, Any] | None = None,
    copy_batch_size: int = DEFAULT_COPY_BATCH,
    marks: bool = False,
    **watch_options: Any,
) -> AsyncSnapshotThenWatch:
    """Every document of a collection as it was at one cluster time T, then its changes after T.

    First yields one insert-shaped record per document (``operationType:
    "insert"``, ``fullDocument``, ``documentKey``, ``clusterTime`` = the read
    time, and ``snapshot: {eventsMayRepeat}``) in ``_id`` order, read with
    ``readConcern: {level: "snapshot", atClusterTime: T}`` (MongoDB 5.0+);
    then the change stream from ``Timestamp(T.time, T.inc + 1)``. ``pipeline``
    applies to both. :attr:`AsyncSnapshotThenWatch.resume_token` is always the
    position after the last returned record or change: pass it back as
    ``resume_after`` to continue (the copy from the next ``_id`` at the same
    T, or the stream). ``watch_options`` are ``watch``'s, except the start
    options. ``marks=True`` (what ``on_history_lost="resnapshot"`` uses) also
    yields a ``snapshotStart`` record before the first document and a
    ``snapshotEnd`` record after the last, so a sink can drop the documents
    the copy did not bring (a restart within the copy keeps the marks). See
    ``docs/snapshot.md`` for the guarantees.
    """
    target = unwrap(target)
    if not isinstance(target, AsyncCollection):
        raise TypeError(
            "snapshot_then_watch() needs a pymongo AsyncCollection (a snapshot copies one "
            f"collection), not {type(target).__name__}"
        )
    check_watch_options(watch_options)
    return AsyncSnapshotThenWatch(target, pipeline, resume_after, copy_batch_size, watch_options,
                                  marks=marks)


class AsyncSnapshotThenWatch:
    """Iterator over snapshot records, then changes (same polling surface as :class:`AsyncChangeStream`)."""

    def __init__(
        self,
        collection: AsyncCollection[Any],
        pipeline: list[Mapping[str, Any]] | None,
        resume_after: Mapping[str, Any] | None,
        copy_batch_size: int,
        watch_options: dict[str, Any],
        *,
        marks: bool = False,
    ) -> None:
        self._collection = collection
        self._pipeline = list(pipeline or [])
        self._options = watch_options
        self._run = SnapshotRun(
            collection.database.name, collection.name, self._pipeline, resume_after,
            copy_batch_size=copy_batch_size, marks=marks,
        )
        self._session = collection.database.client.start_session(causal_consistency=False)
        self._read = AsyncCursorReader(collection.database, self._session,
                                       collection.codec_options)
        self._stream: AsyncChangeStream[Any] | None = None
        self._reads_ahead = False
        self._closed = False

    @property
    def resume_token(self) -> Any:
        """The position after the last returned record or change (``None`` before the first command)."""
        if self._stream is not None and self._stream.resume_token is not None:
            return self._stream.resume_token
        return self._run.token

    @property
    def copying(self) -> bool:
        """Still in the copy phase."""
        return self._run.copying

    @property
    def position(self) -> Any:
        """The change stream's position once streaming (``None`` during the copy)."""
        return None if self._stream is None else self._stream.position

    @property
    def resumes(self) -> int:
        """Resumes of the change stream (the copy has none)."""
        return 0 if self._stream is None else self._stream.resumes

    @property
    def alive(self) -> bool:
        if self._closed:
            return False
        return self._stream.alive if self._stream is not None else True

    # -- the consumers' view (changestream._stream_view.StreamView) -----------------------------
    @property
    def buffered(self) -> int:
        """Changes the change stream holds unreturned; during the copy, the records fetched
        and not yet returned (a poll then needs no I/O either)."""
        return self._run.fetched if self._stream is None else self._stream.buffered

    @property
    def stalled(self) -> bool:
        """The change stream resumed and no getMore succeeded since (never during the copy)."""
        return self._stream is not None and self._stream.stalled

    @property
    def client(self) -> Any:
        """The change stream's client (``None`` during the copy: no oplog position yet)."""
        return None if self._stream is None else self._stream.client

    def carried_token(self) -> Any:
        """The position after the last record or change (see :attr:`resume_token`)."""
        carried = None if self._stream is None else self._stream.carried_token()
        return self.resume_token if carried is None else carried

    def present_token(self, carried: Any) -> Any:
        """A carried token as the change stream presents it (copy positions, and tokens
        already presented, as they are)."""
        if self._stream is None or not isinstance(carried, (bytes, RawBSONDocument)):
            return carried
        return self._stream.present_token(carried)

    def take_carried(self, limit: int) -> list[tuple[Any, Any]]:
        """Buffered changes of the change stream (``[]`` during the copy: one at a time)."""
        return [] if self._stream is None else self._stream.take_carried(limit)

    async def try_next(self) -> Any:
        """The next record or change; ``None`` when the stream had nothing (at most one getMore)."""
        if self._closed:
            return None
        run = self._run
        record = run.buffered()
        if record is not None:
            return record
        stream = self._stream
        if stream is not None:  # the copy is over: the change stream's alone (per change)
            return await stream.try_next()
        while True:
            action = run.next_action()
            if isinstance(action, DeliverRecord):
                return action.record
            if isinstance(action, RunCommand):
                try:
                    reply = await self._read(action.command.body)
                except OperationFailure as exc:
                    if not run.on_error(exc.code, str(exc)):
                        raise
                else:
                    run.on_reply(reply)
                continue
            if self._stream is None:
                await self._end_session()
                self._stream = await watch(
                    self._collection, self._pipeline, **action.start, **self._options
                )
                if self._reads_ahead:
                    self._stream.read_ahead()
            return await self._stream.try_next()

    async def next(self) -> Any:
        """Wait for the next record or change; ``StopAsyncIteration`` once closed or invalidated."""
        while self.alive:
            change = await self.try_next()
            if change is not None:
                return change
        raise StopAsyncIteration

    __anext__ = next

    def __aiter__(self) -> AsyncSnapshotThenWatch:
        return self

    async def close(self) -> None:
        """Kill an open copy cursor, end the session, close the stream (idempotent)."""
        if self._closed:
            return
        self._closed = True
        kill = self._run.kill_command()
        if kill is not None:
            with contextlib.suppress(Exception):
                await self._read(kill.body)
        await self._end_session()
        if self._stream is not None:
            await self._stream.close()

    def read_ahead(self) -> None:
        """The change stream, once open, reads ahead (see :meth:`AsyncChangeStream.read_ahead`);
        the copy's reads are not affected."""
        self._reads_ahead = True
        if self._stream is not None:
            self._stream.read_ahead()

    async def interrupt(self) -> None:
        """End a poll waiting on the change stream, from another thread or task: closes the
        change stream if one is open, nothing else. The copy shares one session between its
        commands (a close from aside would end it under a getMore) and each of its commands
        returns promptly; :meth:`close`, by whoever polls, ends the rest."""
        stream = self._stream
        if stream is not None:
            await stream.close()

    async def _end_session(self) -> None:
        with contextlib.suppress(Exception):
            await self._read.close()
        with contextlib.suppress(Exception):
            await self._session.end_session()

    async def __aenter__(self) -> AsyncSnapshotThenWatch:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


def stream_opener(
    source: Any,
    *,
    initial_snapshot: bool,
    pipeline: list[Mapping[str, Any]] | None,
    watch_options: Mapping[str, Any] | None,
    oversize: str = "fail",
    marks: bool = False,
) -> Any:
    """``consume``'s ``open_stream``: ``source`` itself, or one built for a collection.

    ``oversize="split"`` opens it with ``reassemble_split_events=True``;
    ``marks=True``: a new copy is bounded by ``snapshotStart``/``snapshotEnd`` records.
    """
    source = unwrap(source)
    is_collection = isinstance(source, AsyncCollection)
    problem = opener_arguments_error(is_collection, initial_snapshot, pipeline, watch_options,
                                     oversize)
    if problem is not None:
        raise (ValueError if oversize not in OVERSIZE_CHOICES else TypeError)(problem)
    if not is_collection:
        return source
    options = dict(watch_options or {})
    if oversize == "split":
        options["reassemble_split_events"] = True
    copy_batch_size = options.pop("copy_batch_size", DEFAULT_COPY_BATCH)
    # where a run starts while the store holds no token; a stored token wins over them
    first = {"resume_after": None, **{name: options.pop(name) for name in STARTS if name in options}}

    options.setdefault("batch_size", READ_AHEAD_BATCH)  # (what reading ahead overlaps)

    async def open_stream(token: Any) -> Any:
        stream: AsyncChangeStream[Any] | AsyncSnapshotThenWatch
        if opens_snapshot(token, initial_snapshot):
            stream = await snapshot_then_watch(
                source, pipeline, resume_after=token, copy_batch_size=copy_batch_size,
                marks=marks, **options,
            )
        else:
            start = first if token is None else {"resume_after": token}
            stream = await watch(source, pipeline, **start, **options)
        stream.read_ahead()  # the server builds the next batch while the handler works
        return stream

    return open_stream


_VIEW: type[StreamView] = AsyncSnapshotThenWatch
"""What ``consume`` and the hub read of it (checked by ``mypy``: see :mod:`changestream._stream_view`)."""
