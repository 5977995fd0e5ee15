"""The synchronous :class:`ChangeStream`: a thin shell driving the state machine over PyMongo.

All spec logic lives in :mod:`changestream.machine`; this module only runs
the commands the machine asks for (through :mod:`changestream._pymongo`),
applies the per-call client-side timeout, serialises callers and turns the
machine's verdicts into return values and exceptions.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Generic, TypeVar

from pymongo.synchronous.mongo_client import MongoClient

from ._machine import (
    NOT_BUFFERED,
    ChangeStreamMachine,
    Deliver,
    ErrorInfo,
    NoDocument,
    Raise,
)
from ._options import (
    ChangeStreamOptions,
    resolve_target,
)
from ._pymongo import SyncTransport
from ._shell import Progress, abandon, call_deadline, stream_setup
from ._token import ResumeToken

__all__ = ["ChangeStream"]

_T = TypeVar("_T")


class ChangeStream(Progress, Generic[_T]):
    """A resumable change stream (same surface as ``pymongo.change_stream.ChangeStream``).

    Create it with :func:`changestream.watch` (or ``.watch()`` on the
    wrappers); the initial ``aggregate`` runs immediately, so errors such as
    an invalid pipeline surface at creation.

    Iterate with ``for change in stream`` / :meth:`next` (blocks until a
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
    can continue with ``start_after=stream.resume_token``. Interrupting a call
    (``KeyboardInterrupt``) kills the server cursor and closes the stream, but
    :attr:`resume_token` stays readable.
    """

    def __init__(self, target: Any, options: ChangeStreamOptions) -> None:
        resolved = resolve_target(target)
        if not isinstance(resolved.client, MongoClient):
            raise TypeError("ChangeStream needs a synchronous pymongo MongoClient target")
        self._setup = stream_setup(resolved, options)
        self._codec = self._setup.codec
        self._transport = SyncTransport(resolved.client, options.session, self._setup.wire)
        self._machine = ChangeStreamMachine(self._setup.spec)
        self._lock = threading.RLock()
        self._close_requested = False
        with self._lock, self._deadline():
            self._machine.start()
            self._run(interruptible=False)

    # -- public surface ---------------------------------------------------------
    @property
    def resume_token(self) -> Any:
        """The token a resume would use now: pass it as ``resume_after`` (or ``start_after``).

        ``None`` until the stream has one (no start option and no batch yet).
        """
        return ResumeToken.present(self._machine.resume_token, self._codec)

    def get_resume_token(self) -> Any:
        """Same as :attr:`resume_token` (the spec's ``getResumeToken()``)."""
        return self.resume_token

    @property
    def alive(self) -> bool:
        """False once closed or invalidated; ``True`` does not promise a next change."""
        return self._machine.alive

    def next(self) -> _T:
        """Block until the next change; raise ``StopIteration`` once the stream is closed."""
        lock = self._lock
        lock.acquire()  # not ``with``: half the cost, on the per-event path
        try:
            if self._close_requested:
                raise StopIteration
            document = self._machine.next_buffered()
            if document is NOT_BUFFERED:
                with self._deadline():
                    self._machine.begin_next()
                    document = self._run(interruptible=True)
        finally:
            lock.release()
        if document is None:
            raise StopIteration
        return document  # type: ignore[no-any-return]

    __next__ = next

    def try_next(self) -> _T | None:
        """Return a buffered change, else run at most one getMore; ``None`` if nothing came.

        After a resume caused by an error, only the new cursor's first batch is
        consulted. Returns ``None`` on a closed stream.
        """
        lock = self._lock
        lock.acquire()  # not ``with``: half the cost, on the per-event path
        try:
            if self._close_requested:
                return None
            document = self._machine.next_buffered()
            if document is not NOT_BUFFERED:
                return document  # type: ignore[no-any-return]
            with self._deadline():
                self._machine.begin_try_next()
                return self._run(interruptible=True)  # type: ignore[no-any-return]
        finally:
            lock.release()

    def close(self) -> None:
        """Kill the server cursor and end the stream's implicit session (idempotent).

        May be called from another thread: a blocked :meth:`next` stops after
        its current getMore returns.
        """
        self._close_requested = True
        with self._lock, self._deadline():
            self._machine.close()
            self._run(interruptible=False)

    def __iter__(self) -> Iterator[_T]:
        return self

    def __del__(self) -> None:
        """Dropped without ``close()``: see :func:`changestream.shell.abandon`."""
        abandon(self)

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
    def _deadline(self) -> contextlib.AbstractContextManager[None]:
        """The per-call CSOT budget (see :func:`changestream.shell.call_deadline`)."""
        return call_deadline(self._setup)

    def _run(self, *, interruptible: bool) -> Any:
        """Pump the machine until the current operation ends."""
        machine = self._machine
        try:
            while True:
                if interruptible and self._close_requested:
                    return None
                action = machine.next_action()
                if isinstance(action, Deliver):
                    return action.document
                if isinstance(action, NoDocument):
                    return None
                if isinstance(action, Raise):
                    raise action.error
                try:
                    outcome = self._transport.run(action)
                except BaseException:
                    # Interrupted mid-command: kill the cursor, keep the token, re-raise.
                    machine.abort()
                    self._run(interruptible=False)
                    raise
                if isinstance(outcome, ErrorInfo):
                    machine.receive_error(outcome)
                else:
                    machine.receive_reply(*outcome)
        finally:
            if not machine.alive and not machine.busy:
                self._transport.close()
