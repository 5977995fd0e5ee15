# Generated from changestream/aio/_stream.py by tools/gen_sync.py: edit that file, then run `python tools/gen_sync.py`.
"""The change stream shell: the I/O loop that drives the state machine over PyMongo.

All spec logic lives in :mod:`changestream._machine`, and everything the two
shells share in :class:`changestream._shell.StreamShell`; this module only runs
the commands the machine asks for (through :mod:`changestream._pymongo`),
serialises callers with a lock and turns the machine's verdicts into return
values and exceptions. It is the one source of both shells:
``tools/gen_sync.py`` writes ``changestream/_stream.py`` from it. Two things
are async-only: cancellation (the server cursor is killed in the background)
and the optional ``on_resume_token_change`` callback (the spec allows it only
in async drivers); a sync call interrupted by ``KeyboardInterrupt`` kills the
cursor before it returns.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any, Generic, TypeVar

from pymongo.synchronous.client_session import ClientSession
from pymongo.synchronous.mongo_client import MongoClient

from ._diagnosis import wrong_client_message
from ._machine import (
    NOT_BUFFERED,
    Deliver,
    NoDocument,
    Raise,
)
from ._options import (
    ChangeStreamOptions,
    resolve_target,
)
from ._pymongo import SyncTransport
from ._shell import StreamShell
from ._stream_view import StreamView

__all__ = ["ChangeStream"]

_T = TypeVar("_T")



class ChangeStream(StreamShell, Generic[_T]):
    """A resumable change stream (same surface as ``pymongo.change_stream.ChangeStream``).

    Create it with ``changestream.watch(target)`` (sync:
    :func:`changestream.watch`, or ``.watch()`` on the wrappers); the initial
    ``aggregate`` has run when it is returned, so errors such as an invalid
    pipeline surface at creation.

    Iterate with ``for change in stream`` / :meth:`next` (waits until a
    change arrives) or poll with :meth:`try_next` (at most one ``getMore``).
    To store progress and receive *every* resume token update, including
    those from empty batches, read :attr:`resume_token` after each
    :meth:`try_next`, whether or not it returned a change::

        with changestream.watch(coll) as stream:
            while stream.alive:
                change = stream.try_next()
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
    ) -> None:
        resolved = resolve_target(target)
        if not isinstance(resolved.client, MongoClient):
            raise TypeError(wrong_client_message(aio=False))
        if options.session is not None and not isinstance(options.session, ClientSession):
            raise TypeError("session must be a ClientSession of the same MongoClient")
        super().__init__(resolved, options, SyncTransport)
        self._transport: SyncTransport
        self._lock = threading.RLock()

    def _start(self) -> None:
        """Run the initial aggregate (called by :func:`watch`)."""
        with self._lock:
            with self._deadline():
                self._machine.start()
                self._run(interruptible=False)

    # -- public surface (resume_token, alive: StreamShell) --------------------------
    def next(self) -> _T:
        """Wait for the next change; raise ``StopIteration`` once the stream is closed."""
        with self._lock:
            if self._close_requested:
                raise StopIteration
            document = self._machine.next_buffered()
            if document is NOT_BUFFERED:
                with self._deadline():
                    self._machine.begin_next()
                    document = self._run(interruptible=True)
        if document is None:
            raise StopIteration
        return document  # type: ignore[no-any-return]

    __next__ = next

    def try_next(self) -> _T | None:
        """Return a buffered change, else run at most one getMore; ``None`` if nothing came.

        After a resume caused by an error, only the new cursor's first batch is
        consulted. Returns ``None`` on a closed stream.
        """
        with self._lock:
            if self._close_requested:
                return None
            document = self._machine.next_buffered()
            if document is not NOT_BUFFERED:
                return document  # type: ignore[no-any-return]
            with self._deadline():
                self._machine.begin_try_next()
                return self._run(interruptible=True)  # type: ignore[no-any-return]

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
        with self._lock:
            if self._close_requested:
                return []
            return self._take_buffered(limit, raw_tokens, event_bytes)

    def close(self) -> None:
        """Kill the server cursor and end the stream's implicit session (idempotent).

        May be called from another thread or task: a waiting :meth:`next`
        stops after its current getMore returns.
        """
        self._close_requested = True
        with self._lock:
            with self._deadline():
                self._machine.close()
                self._run(interruptible=False)

    def __iter__(self) -> ChangeStream[_T]:
        return self

    def __enter__(self) -> ChangeStream[_T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- the driving loop ------------------------------------------------------
    def _run(self, *, interruptible: bool) -> Any:
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
                        return action.document
                    else:
                        self._feed(self._transport.run(action))
                        continue
                except BaseException:
                    # Interrupted mid-command (or the callback failed): close, kill the cursor.
                    self._interrupted()
                    raise
                raise error  # the stream's own error: it stays as the machine left it
        finally:
            if self._finished:
                self._transport.close()

    def _interrupted(self) -> None:
        """Close the stream at once: kill its cursor and end the session before returning."""
        self._machine.abort()
        self._run(interruptible=False)


_VIEW: type[StreamView] = ChangeStream
"""What ``consume`` and the hub read of it (checked by ``mypy``: see :mod:`changestream._stream_view`)."""
