"""What the sync and async shells share: everything but the await points.

Both shells drive the same :class:`~changestream._machine.ChangeStreamMachine`;
:class:`StreamShell` makes sure they also configure it identically (target
scope, read preference and concern, timeouts, codecs), present the token and
feed outcomes the same way, and apply CSOT the same way. A shell adds only
the I/O: running commands (awaited or not), its lock, and, for asyncio,
cancellation and the token callback.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pymongo
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument

from ._machine import NOT_BUFFERED, ChangeStreamMachine, ErrorInfo, StreamSpec
from ._options import (
    ChangeStreamOptions,
    Target,
    check_max_await,
    effective_codec_options,
    effective_timeout_ms,
    event_decoder,
    reply_codec,
)
from ._position import Position
from ._pymongo import CommandResult, csot_context_active
from ._token import ResumeToken, raw_event_token


@dataclasses.dataclass(frozen=True)
class StreamSetup:
    """Everything ``watch()`` decides once for a stream."""

    spec: StreamSpec
    codec: CodecOptions[Any]
    """What the user receives (and how :attr:`resume_token` is presented)."""
    wire: CodecOptions[Any]
    """How replies are decoded by the transport."""
    timeout_ms: float | None
    timeout_is_explicit: bool


def stream_setup(target: Target, options: ChangeStreamOptions) -> StreamSetup:
    """Resolve timeouts and codecs and build the machine's spec (raises on bad combinations)."""
    timeout_ms = effective_timeout_ms(options, target.client)
    check_max_await(options, timeout_ms)
    codec = effective_codec_options(options, target)
    wire = reply_codec(codec, options.typed)
    spec = StreamSpec(
        database=target.database,
        collection=target.collection,
        cluster=target.cluster,
        options=options,
        read_preference=options.read_preference
        if options.read_preference is not None
        else target.read_preference,
        read_concern=options.read_concern
        if options.read_concern is not None
        else target.read_concern,
        retry_reads=target.client.options.retry_reads,
        decode=event_decoder(codec, options.typed, wire),
    )
    return StreamSetup(spec, codec, wire, timeout_ms, options.timeout_ms is not None)


def call_deadline(setup: StreamSetup) -> contextlib.AbstractContextManager[None]:
    """The per-call CSOT budget (``timeout_ms=0`` disables a client-level timeout).

    As in PyMongo, a caller's ``with pymongo.timeout(...)`` block replaces the
    client's ``timeoutMS``; an explicit ``timeout_ms`` still applies (the
    earlier deadline wins). ``pymongo.timeout`` works in sync and async code.
    """
    inherited_but_overridden = not setup.timeout_is_explicit and csot_context_active()
    if setup.timeout_ms is None or inherited_but_overridden:
        return contextlib.nullcontext()
    return pymongo.timeout(setup.timeout_ms / 1000)


class StreamProgress:
    """What both shells show of a stream's progress (read from the machine; no I/O)."""

    _machine: ChangeStreamMachine

    @property
    def position(self) -> Position:
        """Cluster time of the resume token and the newest server time seen (see :attr:`lag`)."""
        return self._machine.position

    @property
    def lag(self) -> timedelta | None:
        """How far the stream is behind the server now, without the client's wall clock.

        ``server time - token time`` (the newest cluster time any reply of this
        stream carried, minus the cluster time of the last event returned, or of
        the ``postBatchResumeToken`` once a batch is consumed) plus the local
        monotonic time since that reply, so it keeps growing while a big batch
        is handled or the deployment is down. After an empty getMore: the reply's
        cluster time minus its ``postBatchResumeToken``'s (0 once caught up on a
        replica set). Negative when the token is ahead of the server. ``None``
        until both cluster times are known. See :class:`changestream.Position`.
        """
        return self._machine.position.lag

    @property
    def resumes(self) -> int:
        """Automatic resumes so far (after a resumable error or a client-side timeout)."""
        return self._machine.resumes


class StreamShell(StreamProgress):
    """The I/O-free half of :class:`~changestream.ChangeStream` and its asyncio twin."""

    def __init__(
        self, target: Target, options: ChangeStreamOptions, transport: Callable[..., Any]
    ) -> None:
        """``transport(client, session, reply_codec)`` builds the shell's transport."""
        self._setup = stream_setup(target, options)
        self._codec = self._setup.codec
        self._presenter = ResumeToken.presenter(self._codec)
        self._client = target.client
        self._transport = transport(target.client, options.session, self._setup.wire)
        self._machine = ChangeStreamMachine(self._setup.spec)
        self._close_requested = False

    @property
    def resume_token(self) -> Any:
        """The token a resume would use now: pass it as ``resume_after`` (or ``start_after``).

        ``None`` until the stream has one (no start option and no batch yet).
        """
        return self._presenter(self._machine.resume_token)

    def _take_buffered(self, limit: int, raw_tokens: bool = False,
                       event_bytes: bool = False) -> list[tuple[Any, Any]]:
        """:meth:`take_buffered` of both shells, under their lock (or on the loop's thread).

        ``event_bytes`` (:meth:`take_carried`): each token as :meth:`carried_token`
        gives it (the raw event's ``bytes`` where the token is inside: no copy per
        change, most are never stored); :meth:`present_token` turns the one stored
        into a token.
        """
        machine, present, carried = self._machine, self._presenter, self.carried_token
        taken: list[tuple[Any, Any]] = []
        while len(taken) < limit:
            document = machine.next_buffered()
            if document is NOT_BUFFERED:
                break
            if event_bytes:
                taken.append((document, carried()))
                continue
            token = machine.resume_token
            if not raw_tokens or type(token) is not RawBSONDocument:
                token = present(token)  # (a token the machine holds as a dict is copied)
            taken.append((document, token))
        return taken

    def carried_token(self) -> Any:
        """The machine's token as it holds it, or the bytes of the raw event it is in (see
        :meth:`take_carried`): ``consume`` presents only the tokens it stores
        (:class:`~changestream._stream_view.StreamView`). Not presented here: a token held
        on its own (the postBatchResumeToken, or a copy out of an event over 4 KiB, which
        ``bson`` hands over as a view) would be decoded per change for nothing."""
        machine = self._machine
        event = machine.token_event
        return machine.resume_token if event is None else event.raw

    def present_token(self, carried: Any) -> Any:
        """A token from :meth:`carried_token` or :meth:`take_carried`, in the stream's
        document class: the bytes of a raw event give the token inside it."""
        if type(carried) is bytes:
            carried = raw_event_token(carried)
        return self._presenter(carried)

    @property
    def stalled(self) -> bool:
        """The stream resumed and no getMore succeeded since (``_machine.MAX_IDLE_RESUMES``):
        a token that moved meanwhile is saved but is no progress."""
        return bool(self._machine.idle_resumes)

    @property
    def client(self) -> Any:
        """The PyMongo client the stream reads through."""
        return self._client

    def get_resume_token(self) -> Any:
        """Same as :attr:`resume_token` (the spec's ``getResumeToken()``)."""
        return self.resume_token

    @property
    def buffered(self) -> int:
        """Changes received and not yet returned: a poll now needs no I/O while two or more wait."""
        return self._machine.buffered

    @property
    def alive(self) -> bool:
        """False once closed, cancelled or invalidated; ``True`` does not promise a next change."""
        return self._machine.alive

    def __del__(self) -> None:
        """Dropped without ``close()``: the stream cleans up later.

        As PyMongo's own cursors do, the open cursor is queued for the client's
        background killCursors task and the implicit session goes back to the pool;
        no I/O here. Closing the stream is still the way to release the cursor at once.
        """
        try:
            machine, transport, closing = self._machine, self._transport, self._close_requested
        except AttributeError:  # __init__ failed early
            return
        if closing or not machine.alive:
            return
        with contextlib.suppress(Exception):  # at interpreter exit PyMongo may be gone
            transport.abandon(machine.abandon())

    def _deadline(self) -> contextlib.AbstractContextManager[None]:
        """The per-call CSOT budget (see :func:`call_deadline`)."""
        return call_deadline(self._setup)

    def _feed(self, outcome: CommandResult) -> None:
        """Hand a command's outcome to the machine."""
        if isinstance(outcome, ErrorInfo):
            self._machine.receive_error(outcome)
        else:
            self._machine.receive_reply(*outcome)

    @property
    def _finished(self) -> bool:
        """Closed and idle: time to end the session."""
        machine = self._machine
        return not machine.alive and not machine.busy
