"""The change stream shell: the I/O loop that drives the state machine over PyMongo.

All spec logic lives in :mod:`changestream._machine`, and everything the two
shells share in :class:`changestream._shell.StreamShell`; this module only runs
the commands the machine asks for (through :mod:`changestream._pymongo`),
serialises callers with a lock and turns the machine's verdicts into return
values and exceptions. Two things are async-only: cancellation (the server
cursor is killed in the background) and the optional ``on_resume_token_change``
callback (the spec allows it only in async drivers); a sync call interrupted by
``KeyboardInterrupt`` kills the cursor before it returns.

This asyncio module is the one source of both shells: ``tools/gen_sync.py``
writes ``changestream/_sync/_stream.py`` from it.
"""

from __future__ import annotations

import asyncio  # sync: import threading
import inspect  # async-only
from collections.abc import Callable  # async-only
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.mongo_client import AsyncMongoClient

from .. import _read_ahead
from .._actions import KillCursors
from .._diagnosis import wrong_client_message
from .._machine import (
    NOT_BUFFERED,
    Action,  # async-only
    Deliver,
    NoDocument,
    Raise,
)
from .._options import (
    ChangeStreamOptions,
    resolve_target,
)
from .._pymongo import AsyncTransport
from .._shell import StreamShell
from .._stream_view import StreamView
from .._token import ResumeToken  # async-only

if TYPE_CHECKING:
    from .._pymongo import CommandResult

__all__ = ["AsyncChangeStream", "TokenCallback"]  # sync: __all__ = ["ChangeStream"]

_T = TypeVar("_T")

# async-only: begin
TokenCallback = Callable[[Any], Any]
"""``on_resume_token_change(token)``: a function or a coroutine function."""

_BACKGROUND: set[asyncio.Task[None]] = set()
"""Strong references to background cursor kills (the event loop keeps only weak ones)."""
# async-only: end


class AsyncChangeStream(StreamShell, Generic[_T]):
    """A resumable change stream (same surface as ``pymongo.change_stream.ChangeStream``).

    Create it with ``await changestream.aio.watch(target)`` (sync:
    :func:`changestream.watch`, or ``.watch()`` on the wrappers); the initial
    ``aggregate`` has run when it is returned, so errors such as an invalid
    pipeline surface at creation.

    Iterate with ``async for change in stream`` / :meth:`next` (waits until a
    change arrives) or poll with :meth:`try_next` (at most one ``getMore``).
    To store progress and receive *every* resume token update, including
    those from empty batches, read :attr:`resume_token` after each
    :meth:`try_next`, whether or not it returned a change::

        async with await changestream.aio.watch(coll) as stream:
            while stream.alive:
                change = await stream.try_next()
                save(stream.resume_token)      # always the most up-to-date token
                if change is not None:
                    process(change)

    Timeouts (``timeout_ms``, or the client's ``timeoutMS``) bound each
    :meth:`next` / :meth:`try_next` call, including any resume. A timed-out
    call does not invalidate the stream: call it again (it first resumes on
    the server) or close the stream and create a new one. If the timeout hits
    before any event was received, the server may not be able to process the
    existing oplog in time: close and re-create the stream with a higher
    timeout.

    An ``invalidate`` event (collection dropped/renamed) is returned, then the
    stream closes; its ``_id`` stays in :attr:`resume_token` so a new stream
    can continue with ``start_after=stream.resume_token``.

    Interrupting a call (``KeyboardInterrupt`` in sync code; cancelling the
    task in asyncio, also via ``asyncio.timeout`` or ``wait_for``) closes the
    stream and kills the server cursor (asyncio: in the background, and
    :meth:`close` waits for that); :attr:`resume_token` stays readable so a
    new stream can continue with ``resume_after=stream.resume_token``.
    :meth:`close` from another thread or task lets a waiting :meth:`next`
    finish its current ``getMore`` first (at most ``max_await_time_ms``).
    """

    def __init__(
        self,
        target: Any,
        options: ChangeStreamOptions,
        # async-only: begin
        *,
        on_resume_token_change: TokenCallback | None = None,
        # async-only: end
    ) -> None:
        resolved = resolve_target(target)
        if not isinstance(resolved.client, AsyncMongoClient):
            raise TypeError(wrong_client_message(aio=True))  # sync: raise TypeError(wrong_client_message(aio=False))
        if options.session is not None and not isinstance(options.session, AsyncClientSession):
            raise TypeError("session must be an AsyncClientSession for an async change stream")  # sync: raise TypeError("session must be a ClientSession of the same MongoClient")
        # async-only: begin
        if on_resume_token_change is not None and not callable(on_resume_token_change):
            raise TypeError("on_resume_token_change must be callable")
        # async-only: end
        super().__init__(resolved, options, AsyncTransport)
        self._transport: AsyncTransport
        self._lock = asyncio.Lock()  # sync: self._lock = threading.RLock()
        self._reads_ahead = False
        self._ahead: _read_ahead.TaskAhead | None = None  # sync: self._ahead: _read_ahead.ThreadAhead | None = None
        # async-only: begin
        self._cleanup: asyncio.Task[None] | None = None
        self._on_token = on_resume_token_change
        self._notified = ResumeToken.maybe(self._machine.resume_token)
        # async-only: end

    async def _start(self) -> None:
        """Run the initial aggregate (called by :func:`watch`)."""
        async with self._lock:
            with self._deadline():
                self._machine.start()
                await self._run(interruptible=False)

    # -- public surface (resume_token, alive: StreamShell) --------------------------
    async def next(self) -> _T:
        """Wait for the next change; raise ``StopAsyncIteration`` once the stream is closed."""
        async with self._lock:
            await self._settle()  # async-only
            if self._close_requested:
                raise StopAsyncIteration
            document = await self._next_buffered()  # sync: document = self._machine.next_buffered()
            if document is NOT_BUFFERED:
                with self._deadline():
                    self._machine.begin_next()
                    document = await self._run(interruptible=True)
        if document is None:
            raise StopAsyncIteration
        return document  # type: ignore[no-any-return]

    __anext__ = next

    async def try_next(self) -> _T | None:
        """Return a buffered change, else run at most one getMore; ``None`` if nothing came.

        After a resume caused by an error, only the new cursor's first batch is
        consulted. Returns ``None`` on a closed stream.
        """
        # async-only: begin
        if (self._on_token is None and self._cleanup is None and not self._close_requested
                and not self._lock.locked()):
            # The per-change fast path: nothing awaits between here and the return, and only
            # the loop's thread runs, so holding the lock would change nothing.
            document = self._machine.next_buffered()
            if document is not NOT_BUFFERED:
                return document  # type: ignore[no-any-return]
        # async-only: end
        async with self._lock:
            await self._settle()  # async-only
            if self._close_requested:
                return None
            document = await self._next_buffered()  # sync: document = self._machine.next_buffered()
            if document is not NOT_BUFFERED:
                return document  # type: ignore[no-any-return]
            with self._deadline():
                self._machine.begin_try_next()
                return await self._run(interruptible=True)  # type: ignore[no-any-return]

    def take_buffered(self, limit: int, *, raw_tokens: bool = False) -> list[tuple[_T, Any]]:
        """Up to ``limit`` buffered changes, each with the resume token after it; no I/O.

        For consumers that hand a whole batch on at once (``consume(workers=N)``):
        the same changes and tokens as ``try_next`` and ``resume_token`` one at a
        time, in one call per batch instead of one per change. Takes only what the
        buffer answers without a command (never the last change of a batch); ``[]``
        when there is nothing such, or while another call or a close is under way.

        ``raw_tokens``: each token as the server's bytes (a ``RawBSONDocument``,
        valid as ``resume_after``) instead of the stream's document class: cheaper
        when most of them are never stored.
        """
        return self._take_guarded(limit, raw_tokens, event_bytes=False)

    def take_carried(self, limit: int) -> list[tuple[_T, Any]]:
        """Up to ``limit`` buffered changes, each with :meth:`carried_token`'s form of the
        token after it (``consume`` with workers; see
        :class:`~changestream._stream_view.StreamView`); no I/O."""
        return [] if limit < 1 else self._take_guarded(limit, False, event_bytes=True)

    def _take_guarded(self, limit: int, raw_tokens: bool, *,
                      event_bytes: bool) -> list[tuple[_T, Any]]:
        """:meth:`take_buffered`, and ``consume``'s variant (``event_bytes``: see
        :meth:`StreamShell._take_buffered`)."""
        # async-only: begin
        if (self._on_token is not None or self._cleanup is not None or self._close_requested
                or self._lock.locked()):
            return []
        return self._take_buffered(limit, raw_tokens, event_bytes)
        # async-only: end
        # sync-only: begin
        # with self._lock:
        #     if self._close_requested:
        #         return []
        #     return self._take_buffered(limit, raw_tokens, event_bytes)
        # sync-only: end

    async def close(self) -> None:
        """Kill the server cursor and end the stream's implicit session (idempotent).

        May be called from another thread or task: a getMore that a waiting :meth:`next`
        or :meth:`try_next` has in flight is interrupted (its cursor is killed on a
        connection of its own, so the server ends it at once instead of after
        ``max_await_time_ms``), and that call returns ``None`` or stops iterating.
        """
        self._close_requested = True
        self._machine.request_close()  # the getMore the kill interrupts closes, never resumes
        kill = self._machine.in_flight_kill()  # (only while another call waits on a getMore)
        if kill is not None:
            await self._transport.run_aside(kill)
        async with self._lock:
            await self._settle()  # async-only
            with self._deadline():
                self._machine.close()
                await self._run(interruptible=False)

    async def interrupt(self) -> None:
        """:meth:`close`, which is safe from another thread or task (a waiting getMore is
        killed aside; see :class:`~changestream._stream_view.StreamView`)."""
        await self.close()

    def read_ahead(self) -> None:
        """From now on send each getMore as soon as the batch before it arrives, so the server
        builds the next batch while the caller handles this one (``consume`` does so).

        Nothing else changes: each getMore's outcome reaches the stream when it would have
        asked, the same changes, tokens and errors in the same order. Off by default (the
        spec's command sequence is one getMore per exhausted batch); a close kills the
        cursor of the getMore sent ahead on a connection of its own, so that getMore ends at
        once (``docs/consume.md``, "Reading ahead").
        """
        self._reads_ahead = True

    def __aiter__(self) -> AsyncChangeStream[_T]:
        return self

    async def __aenter__(self) -> AsyncChangeStream[_T]:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    # -- the driving loop ------------------------------------------------------
    async def _run(self, *, interruptible: bool) -> Any:
        """Pump the machine until the current operation ends."""
        machine = self._machine
        try:
            while True:
                if interruptible and self._close_requested:
                    return None
                try:
                    # next_action inside: a Ctrl-C just after it chose a command would
                    # leave that command in flight, and close() would refuse
                    action = machine.next_action()
                    if isinstance(action, NoDocument):
                        return None
                    if isinstance(action, Raise):
                        error = action.error
                    elif isinstance(action, Deliver):
                        await self._notify()  # async-only
                        return action.document
                    else:
                        self._feed(await self._command(action))
                        await self._notify()  # async-only
                        continue
                except BaseException:
                    # Interrupted mid-command (or the callback failed): close, kill the cursor.
                    self._interrupted()
                    raise
                raise error  # the stream's own error: it stays as the machine left it
        finally:
            if self._finished:
                await self._drop_ahead()
                await self._transport.close()

    async def _command(self, action: Any) -> CommandResult:
        """Run the machine's command, or hand it the outcome of the getMore read ahead for it;
        then read the next one ahead if the stream does (:mod:`changestream._read_ahead`)."""
        ahead, self._ahead = self._ahead, None
        outcome: CommandResult | None = None
        if ahead is not None:
            if isinstance(action, KillCursors) and not self._transport.load_balanced:
                await self._transport.run_aside(action)  # a close: the getMore ahead ends now
            earlier = await ahead.outcome()
            if _read_ahead.answers(ahead.action, action):
                outcome = earlier  # else dropped: another command (a close, a resume) comes
        if outcome is None:
            outcome = await self._transport.run(action)
        if self._reads_ahead and not self._close_requested and _read_ahead.reads_ahead(
                action, outcome):
            self._ahead = _read_ahead.TaskAhead(self._transport.run, action)  # sync: self._ahead = _read_ahead.ThreadAhead(self._transport.run, action)
        return outcome

    async def _drop_ahead(self) -> None:
        """Wait for a getMore read ahead and drop its outcome (the stream is closing)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            await ahead.outcome()

    # sync-only: begin
    # def _interrupted(self) -> None:
    #     """Close the stream at once: kill its cursor and end the session before returning."""
    #     self._machine.abort()
    #     self._run(interruptible=False)
    # sync-only: end
    # async-only: begin
    async def _next_buffered(self) -> Any:
        """The machine's per-event fast path (no command to run), with the token callback."""
        document = self._machine.next_buffered()
        if document is not NOT_BUFFERED and self._on_token is not None:
            try:
                await self._notify()
            except BaseException:
                self._interrupted()
                raise
        return document

    async def _notify(self) -> None:
        """Call ``on_resume_token_change`` if the cached token changed since the last call."""
        if self._on_token is None:
            return
        key = ResumeToken.maybe(self._machine.resume_token)
        if key == self._notified:
            return
        self._notified = key
        result = self._on_token(self.resume_token)
        if inspect.isawaitable(result):
            await result

    def _interrupted(self) -> None:
        """Close the stream at once; kill its cursor and end the session in a background task."""
        machine = self._machine
        machine.abort()
        action = machine.next_action()
        task = asyncio.get_running_loop().create_task(self._finish(action))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
        self._cleanup = task

    async def _finish(self, action: Action) -> None:
        """Run what remains of the close (a best-effort killCursors), then end the session."""
        machine = self._machine
        try:
            while not isinstance(action, (Deliver, NoDocument, Raise)):
                try:
                    outcome = await self._transport.run(action)
                except BaseException:
                    # Cancelled again (e.g. the event loop shuts down): the server times it out.
                    machine.abort()
                    machine.next_action()
                    raise
                self._feed(outcome)
                action = machine.next_action()
        finally:
            await self._transport.close()

    async def _settle(self) -> None:
        """Wait for a background close to finish (it never raises here)."""
        task, self._cleanup = self._cleanup, None
        if task is not None:
            await asyncio.wait([task])
    # async-only: end


async def open_stream(
    target: Any,
    options: ChangeStreamOptions,
    # async-only: begin
    *,
    on_resume_token_change: TokenCallback | None = None,
    # async-only: end
) -> AsyncChangeStream[Any]:
    """A new stream with its initial aggregate run (what :func:`watch` returns)."""
    stream: AsyncChangeStream[Any] = AsyncChangeStream(
        target, options,
        on_resume_token_change=on_resume_token_change,  # async-only
    )
    await stream._start()
    return stream


_VIEW: type[StreamView] = AsyncChangeStream
"""What ``consume`` and the hub read of it (checked by ``mypy``: see :mod:`changestream._stream_view`)."""
