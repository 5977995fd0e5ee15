"""The asyncio :class:`AsyncChangeStream`: the sync shell's twin over ``AsyncMongoClient``.

All spec logic lives in :mod:`changestream._machine`, and everything the two
shells share in :class:`changestream._shell.StreamShell`; like
:mod:`changestream._stream`, this module only runs the commands the machine
asks for (through :class:`changestream._pymongo.AsyncTransport`), serialises
callers and turns the machine's verdicts into return values and exceptions.
Two things are async-only: cancellation (the server cursor is killed in the
background) and the optional ``on_resume_token_change`` callback (the spec
allows it only in async drivers).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.mongo_client import AsyncMongoClient

from .._machine import (
    NOT_BUFFERED,
    Action,
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
from .._token import ResumeToken

if TYPE_CHECKING:
    # The types of the generated option parameters (see tools/gen_watch_signatures.py).
    from bson.codec_options import CodecOptions
    from bson.timestamp import Timestamp
    from pymongo.collation import Collation
    from pymongo.read_concern import ReadConcern
    from pymongo.read_preferences import (
        Nearest,
        Primary,
        PrimaryPreferred,
        Secondary,
        SecondaryPreferred,
    )

    from ..events import ChangeEvent

__all__ = ["AsyncChangeStream", "TokenCallback", "watch"]

_T = TypeVar("_T")
_D = TypeVar("_D")

TokenCallback = Callable[[Any], Any]
"""``on_resume_token_change(token)``: a function or a coroutine function."""

_BACKGROUND: set[asyncio.Task[None]] = set()
"""Strong references to background cursor kills (the event loop keeps only weak ones)."""


# As changestream.watch: the event type follows ``typed`` and ``document_class``.
@overload
async def watch(
    target: Any, pipeline: list[Mapping[str, Any]] | None = None, *, typed: Literal[True],
    document_class: type[Any] | None = None, on_resume_token_change: TokenCallback | None = None,
    # BEGIN generated watch options: params async
    full_document: str | None = None,
    full_document_before_change: str | None = None,
    resume_after: Mapping[str, Any] | None = None,
    start_after: Mapping[str, Any] | None = None,
    start_at_operation_time: Timestamp | None = None,
    max_await_time_ms: int | None = None,
    batch_size: int | None = None,
    collation: Mapping[str, Any] | Collation | None = None,
    comment: Any = None,
    show_expanded_events: bool | None = None,
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
    read_concern: ReadConcern | None = None,
    timeout_ms: float | None = None,
    codec_options: CodecOptions[Any] | None = None,
    reassemble_split_events: bool = False,
    session: AsyncClientSession | None = None,
    # END generated watch options
) -> AsyncChangeStream[ChangeEvent]: ...
@overload
async def watch(
    target: Any, pipeline: list[Mapping[str, Any]] | None = None, *,
    typed: Literal[False] = False, document_class: type[_D],
    on_resume_token_change: TokenCallback | None = None,
    # BEGIN generated watch options: params async
    full_document: str | None = None,
    full_document_before_change: str | None = None,
    resume_after: Mapping[str, Any] | None = None,
    start_after: Mapping[str, Any] | None = None,
    start_at_operation_time: Timestamp | None = None,
    max_await_time_ms: int | None = None,
    batch_size: int | None = None,
    collation: Mapping[str, Any] | Collation | None = None,
    comment: Any = None,
    show_expanded_events: bool | None = None,
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
    read_concern: ReadConcern | None = None,
    timeout_ms: float | None = None,
    codec_options: CodecOptions[Any] | None = None,
    reassemble_split_events: bool = False,
    session: AsyncClientSession | None = None,
    # END generated watch options
) -> AsyncChangeStream[_D]: ...
@overload
async def watch(
    target: Any, pipeline: list[Mapping[str, Any]] | None = None, *,
    typed: Literal[False] = False, document_class: None = None,
    on_resume_token_change: TokenCallback | None = None,
    # BEGIN generated watch options: params async
    full_document: str | None = None,
    full_document_before_change: str | None = None,
    resume_after: Mapping[str, Any] | None = None,
    start_after: Mapping[str, Any] | None = None,
    start_at_operation_time: Timestamp | None = None,
    max_await_time_ms: int | None = None,
    batch_size: int | None = None,
    collation: Mapping[str, Any] | Collation | None = None,
    comment: Any = None,
    show_expanded_events: bool | None = None,
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
    read_concern: ReadConcern | None = None,
    timeout_ms: float | None = None,
    codec_options: CodecOptions[Any] | None = None,
    reassemble_split_events: bool = False,
    session: AsyncClientSession | None = None,
    # END generated watch options
) -> AsyncChangeStream[Mapping[str, Any]]: ...
@overload
async def watch(
    target: Any, pipeline: list[Mapping[str, Any]] | None = None, *, typed: bool = False,
    document_class: type[Any] | None = None, on_resume_token_change: TokenCallback | None = None,
    # BEGIN generated watch options: params async
    full_document: str | None = None,
    full_document_before_change: str | None = None,
    resume_after: Mapping[str, Any] | None = None,
    start_after: Mapping[str, Any] | None = None,
    start_at_operation_time: Timestamp | None = None,
    max_await_time_ms: int | None = None,
    batch_size: int | None = None,
    collation: Mapping[str, Any] | Collation | None = None,
    comment: Any = None,
    show_expanded_events: bool | None = None,
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
    read_concern: ReadConcern | None = None,
    timeout_ms: float | None = None,
    codec_options: CodecOptions[Any] | None = None,
    reassemble_split_events: bool = False,
    session: AsyncClientSession | None = None,
    # END generated watch options
) -> AsyncChangeStream[Any]: ...
async def watch(
    target: Any,
    pipeline: list[Mapping[str, Any]] | None = None,
    *,
    typed: bool = False,
    document_class: type[Any] | None = None,
    on_resume_token_change: TokenCallback | None = None,
    # BEGIN generated watch options: params async
    full_document: str | None = None,
    full_document_before_change: str | None = None,
    resume_after: Mapping[str, Any] | None = None,
    start_after: Mapping[str, Any] | None = None,
    start_at_operation_time: Timestamp | None = None,
    max_await_time_ms: int | None = None,
    batch_size: int | None = None,
    collation: Mapping[str, Any] | Collation | None = None,
    comment: Any = None,
    show_expanded_events: bool | None = None,
    read_preference: Primary | PrimaryPreferred | Secondary | SecondaryPreferred | Nearest | None = None,
    read_concern: ReadConcern | None = None,
    timeout_ms: float | None = None,
    codec_options: CodecOptions[Any] | None = None,
    reassemble_split_events: bool = False,
    session: AsyncClientSession | None = None,
    # END generated watch options
    **unknown_options: Any,
) -> AsyncChangeStream[Any]:
    """Open a change stream on a PyMongo ``AsyncMongoClient``, ``AsyncDatabase`` or ``AsyncCollection``.

    The options are those of :func:`changestream.watch`; the initial
    ``aggregate`` has run when the returned awaitable completes::

        async with await changestream.aio.watch(coll) as stream:
            async for change in stream:
                ...

    ``on_resume_token_change(token)`` (a function or a coroutine function)
    is called whenever the cached resume token really changes: after the
    initial aggregate, for each returned change (just before it is
    returned) and for each new ``postBatchResumeToken`` of an empty batch,
    even while :meth:`AsyncChangeStream.next` keeps waiting.
    """
    options = ChangeStreamOptions.from_kwargs(
        pipeline,
        typed=typed,
        document_class=document_class,
        # BEGIN generated watch options: arguments
        full_document=full_document,
        full_document_before_change=full_document_before_change,
        resume_after=resume_after,
        start_after=start_after,
        start_at_operation_time=start_at_operation_time,
        max_await_time_ms=max_await_time_ms,
        batch_size=batch_size,
        collation=collation,
        comment=comment,
        show_expanded_events=show_expanded_events,
        read_preference=read_preference,
        read_concern=read_concern,
        timeout_ms=timeout_ms,
        codec_options=codec_options,
        reassemble_split_events=reassemble_split_events,
        session=session,
        # END generated watch options
        **unknown_options,  # unknown names: from_kwargs raises, listing the valid ones
    )
    stream: AsyncChangeStream[Any] = AsyncChangeStream(
        target, options, on_resume_token_change=on_resume_token_change
    )
    await stream._start()
    return stream


class AsyncChangeStream(StreamShell, Generic[_T]):
    """A resumable change stream for asyncio; same surface as :class:`changestream.ChangeStream`.

    Create it with ``await changestream.aio.watch(target)``. Iterate with
    ``async for`` / :meth:`next` (waits until a change arrives) or poll with
    :meth:`try_next` (at most one ``getMore``); read :attr:`resume_token`
    after each :meth:`try_next` to store progress, or pass
    ``on_resume_token_change`` to :func:`watch`.

    Cancelling a task that waits in :meth:`next` / :meth:`try_next` (also
    via ``asyncio.timeout`` or ``wait_for``) closes the stream: the server
    cursor is killed in the background (:meth:`close` waits for that), the
    session is ended, and :attr:`resume_token` stays readable so a new
    stream can continue with ``resume_after=stream.resume_token``.
    A client-side timeout (``timeout_ms``) does *not* close it: the next call
    resumes. :meth:`close` from another task lets a waiting :meth:`next`
    finish its current ``getMore`` first (at most ``max_await_time_ms``).
    """

    def __init__(
        self,
        target: Any,
        options: ChangeStreamOptions,
        *,
        on_resume_token_change: TokenCallback | None = None,
    ) -> None:
        resolved = resolve_target(target)
        if not isinstance(resolved.client, AsyncMongoClient):
            raise TypeError(
                "AsyncChangeStream needs a pymongo AsyncMongoClient target "
                "(use changestream.watch for a MongoClient)"
            )
        if options.session is not None and not isinstance(options.session, AsyncClientSession):
            raise TypeError("session must be an AsyncClientSession for an async change stream")
        if on_resume_token_change is not None and not callable(on_resume_token_change):
            raise TypeError("on_resume_token_change must be callable")
        super().__init__(resolved, options, AsyncTransport)
        self._transport: AsyncTransport
        self._lock = asyncio.Lock()
        self._cleanup: asyncio.Task[None] | None = None
        self._on_token = on_resume_token_change
        self._notified = ResumeToken.maybe(self._machine.resume_token)

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
            await self._settle()
            if self._close_requested:
                raise StopAsyncIteration
            document = await self._next_buffered()
            if document is NOT_BUFFERED:
                with self._deadline():
                    self._machine.begin_next()
                    document = await self._run(interruptible=True)
        if document is None:
            raise StopAsyncIteration
        return document  # type: ignore[no-any-return]

    __anext__ = next

    async def try_next(self) -> _T | None:
        """Return a buffered change, else run at most one getMore; ``None`` if nothing came."""
        async with self._lock:
            await self._settle()
            if self._close_requested:
                return None
            document = await self._next_buffered()
            if document is not NOT_BUFFERED:
                return document  # type: ignore[no-any-return]
            with self._deadline():
                self._machine.begin_try_next()
                return await self._run(interruptible=True)  # type: ignore[no-any-return]

    async def close(self) -> None:
        """Kill the server cursor and end the stream's implicit session (idempotent)."""
        self._close_requested = True
        async with self._lock:
            await self._settle()
            with self._deadline():
                self._machine.close()
                await self._run(interruptible=False)

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
                action = machine.next_action()
                if isinstance(action, NoDocument):
                    return None
                if isinstance(action, Raise):
                    raise action.error
                try:
                    if isinstance(action, Deliver):
                        await self._notify()
                        return action.document
                    self._feed(await self._transport.run(action))
                    await self._notify()
                except BaseException:
                    # Cancelled (or the callback failed): close now, kill the cursor later.
                    self._interrupted()
                    raise
        finally:
            if self._finished:
                await self._transport.close()

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
