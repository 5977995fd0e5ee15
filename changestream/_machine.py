"""The change-stream state machine: every MUST of the spec, and no I/O.

Like h11, the machine never touches a socket. A shell (sync or async) starts
an operation (:meth:`ChangeStreamMachine.start`, :meth:`~ChangeStreamMachine.begin_next`,
:meth:`~ChangeStreamMachine.begin_try_next`, :meth:`~ChangeStreamMachine.close`),
then repeatedly asks :meth:`~ChangeStreamMachine.next_action` what to do:

* a command (:class:`RunAggregate`, :class:`RunGetMore`, :class:`KillCursors`):
  run it and feed exactly one outcome back with
  :meth:`~ChangeStreamMachine.receive_reply` or :meth:`~ChangeStreamMachine.receive_error`;
* :class:`Deliver` / :class:`NoDocument` / :class:`Raise`: the operation is
  over; return the document, return ``None`` (or stop iterating), or raise.

The machine owns all spec state: the cached resume token, the saved
operation time, the startAfter flag, the buffered batch and its
postBatchResumeToken, the cursor (id, namespace, server address, wire
version), split-event fragments and the resume / retry / timeout bookkeeping;
it builds every command. Server selection, sessions, ``$clusterTime`` and CSOT
deadlines belong to the transport.

*When* anything happens is not decided here but in one table,
:mod:`changestream._states`: each input becomes an
:class:`~changestream._states.Event`, the table gives the next control state,
the effects on the data above and the action to return, and :meth:`_fire`
(the only place control state changes) applies them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Final

from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp

from ._actions import (
    Action,
    Command,
    Deliver,
    ErrorInfo,
    KillCursors,
    NoDocument,
    Raise,
    ReplyInfo,
    RunAggregate,
    RunGetMore,
    StreamSpec,
)
from ._commands import aggregate_command, getmore_command, kill_command, start_options
from ._diagnosis import (
    SPLIT_STAGE,
)
from ._error_rules import check_start_token, explained, is_resumable, is_retryable_read
from ._position import Position, newest_reply_time
from ._replies import IN_EVENT, event_token, not_an_event, parse_cursor
from ._split import SplitReassembler
from ._states import AGGREGATES, INITIAL, RESUMES, Act, Effect, Event, Phase, State, transition
from ._token import describe, raw_event_token, token_in_raw_event
from .errors import (
    ChangeStreamError,
    MalformedReplyError,
    MissingResumeTokenError,
    SplitEventError,
    describe_error,
)

__all__ = [
    "MAX_IDLE_RESUMES",
    "NOT_BUFFERED",
    "Action",
    "ChangeStreamMachine",
    "Command",
    "Deliver",
    "ErrorInfo",
    "KillCursors",
    "NoDocument",
    "Phase",
    "Raise",
    "ReplyInfo",
    "RunAggregate",
    "RunGetMore",
    "StreamSpec",
]

NOT_BUFFERED: Any = object()
"""Returned by :meth:`ChangeStreamMachine.next_buffered` when the fast path does not apply."""
log = logging.getLogger("changestream.stream")
"""Resumes are logged here (INFO), whichever shell drives the machine."""
MAX_IDLE_RESUMES = 3
"""Consecutive resumes allowed without a successful getMore (or a non-empty batch) in between.

Each resumable error still causes exactly one resume (the spec), but when a
server accepts the resume aggregate and then fails every getMore, resuming
for ever would be a hot loop. Once this many resumes in a row brought
nothing, the next resumable error is raised instead (the stream stays
resumable: the next call resumes once more). Callers such as
:func:`changestream.consume` then back off.
"""


@dataclasses.dataclass
class _Cursor:
    id: int
    database: str
    collection: str
    address: Any
    wire_version: int
    load_balanced: bool = False


@dataclasses.dataclass(slots=True)
class _Reply:
    """A reply as far as it was read: what the REPLY effects store (BAD_REPLY: its time only)."""

    server_time: Timestamp | None
    info: ReplyInfo | None = None
    document: Mapping[str, Any] | None = None
    batch: deque[Mapping[str, Any]] = dataclasses.field(default_factory=deque)
    cursor_id: int = 0
    database: str = ""
    collection: str = ""
    post_batch_token: Mapping[str, Any] | None = None


_Effector = Callable[["ChangeStreamMachine", Any, "BaseException | None"],
                     "tuple[Event, Any, BaseException | None] | None"]


class ChangeStreamMachine:
    """One change stream's spec logic; see the module docstring for the protocol.

    Control state is one :class:`~changestream._states.State`, changed only in
    :meth:`_fire` with what :func:`~changestream._states.transition` says; the
    other fields are data, changed by the table's effects.
    """

    def __init__(self, spec: StreamSpec) -> None:
        options = spec.options
        self._spec = spec
        self._decode = spec.decode
        # Spec "Updating the Cached Resume Token": startAfter, else resumeAfter, else unset.
        self._token: Mapping[str, Any] | None = (
            options.start_after if options.start_after is not None else options.resume_after
        )
        self._token_event: RawBSONDocument | None = None
        """A raw event whose ``_id`` is the token, sliced out only when the token is used."""
        self._use_start_after = options.start_after is not None
        """Started with startAfter and no document returned yet: resumes use startAfter."""
        self._operation_time = options.start_at_operation_time
        self._state = INITIAL
        self._cursor: _Cursor | None = None
        self._batch: deque[Mapping[str, Any]] = deque()
        self._post_batch_token: Mapping[str, Any] | None = None
        self._fragments = SplitReassembler() if options.reassemble_split_events else None
        self._split_stage: tuple[Mapping[str, Any], ...] = (
            ({SPLIT_STAGE: {}},)
            if options.reassemble_split_events
            and not any(SPLIT_STAGE in stage for stage in options.pipeline)
            else ()
        )
        """reassemble_split_events without the split stage in the pipeline: it is appended."""
        self._error: BaseException | None = None
        """What the plan's RAISE raises."""
        self._server_time: Timestamp | None = None
        """Newest cluster time seen in a reply (see :attr:`position`)."""
        self.clock: Callable[[], float] = time.monotonic
        """The local monotonic clock the lag counts with (tests set their own)."""
        self._reply_at: float | None = None
        """Local monotonic time of the last reply (the lag counts from it; no wall clock)."""
        self._server_seen_at: float | None = None
        """Local monotonic time the newest server time was first seen: an idle deployment's
        cluster time stands still (writes and a no-op every 10 s move it), local time does not."""
        self._empty_getmore = False
        """The last reply was a getMore with an empty batch (caught up, see :attr:`position`)."""
        self._asked_at: float | None = None
        """Local monotonic time the caller last asked for more with nothing buffered."""
        self._handling: tuple[Any, Any, Mapping[str, Any]] | None = None
        """The batch's last event while the caller handles it (the token is already the
        postBatchResumeToken; the lag still counts from the event)."""
        max_await = options.max_await_time_ms
        self._await_seconds = 1.0 if max_await is None else max_await / 1000
        self._close_requested = False  # see request_close
        self._resumes = 0
        self._idle_resumes = 0
        """Resumes since the last successful getMore or non-empty batch (see MAX_IDLE_RESUMES)."""

    # -- state ------------------------------------------------------------------
    @property
    def resume_token(self) -> Mapping[str, Any] | None:
        """The token a resume would use now (spec: ``getResumeToken()``)."""
        event = self._token_event
        if event is not None:
            # Raw events: the token is copied out of the event once it is asked for,
            # not per event (most are never asked for).
            self._token, self._token_event = raw_event_token(event.raw), None
        return self._token

    @property
    def token_event(self) -> RawBSONDocument | None:
        """The raw event whose ``_id`` is the current token (``None``: the token is held on
        its own): :attr:`resume_token` slices it out when asked."""
        return self._token_event

    @property
    def position(self) -> Position:
        """Cluster time of the resume token, newest server time seen, and the lag between them.

        Reads without changing anything (the stats timer reads it from another
        thread while the stream runs): a raw event's token is sliced, not cached.
        """
        event = self._token_event
        current = self._token if event is None else raw_event_token(event.raw)
        reply_at = self._reply_at
        if reply_at is None:
            return Position.of(current, self._server_time)
        now = self.clock()
        handling = self._handling
        if self._batch or handling is not None:
            # A batch is being handled: everything since its reply counts.
            token = current
            if handling is not None:
                _, event_token, last = handling
                token = raw_event_token(last.raw) if event_token is IN_EVENT else event_token  # type: ignore[attr-defined]
            seen_at = reply_at if self._server_seen_at is None else self._server_seen_at
            return Position.of(token, self._server_time, reply_age=now - seen_at,
                               await_seconds=self._await_seconds)
        # Everything received is handled and more was asked for: only an overdue reply counts.
        asked_at = self._asked_at
        anchor = reply_at if asked_at is None else max(reply_at, asked_at)
        return Position.of(
            current, self._server_time, reply_age=now - anchor, waiting=True,
            caught_up=self._empty_getmore, await_seconds=self._await_seconds,
        )

    @property
    def resumes(self) -> int:
        """Resume attempts so far (each kills the old cursor, if any, and aggregates again)."""
        return self._resumes

    @property
    def state(self) -> State:
        """The whole control state (see :mod:`changestream._states`)."""
        return self._state

    @property
    def phase(self) -> Phase:
        return self._state.phase

    @property
    def alive(self) -> bool:
        return self._state.phase is not Phase.CLOSED

    @property
    def operation_time(self) -> Any:
        """``startAtOperationTime`` a resume without token would use."""
        return self._operation_time

    @property
    def cursor_id(self) -> int | None:
        return None if self._cursor is None else self._cursor.id

    @property
    def address(self) -> Any:
        """Server holding the current cursor."""
        return None if self._cursor is None else self._cursor.address

    @property
    def buffered(self) -> int:
        """Documents received but not yet returned."""
        return len(self._batch)

    @property
    def idle_resumes(self) -> int:
        """Resumes in a row that brought no successful getMore and no document (0: healthy)."""
        return self._idle_resumes

    def in_flight_kill(self) -> KillCursors | None:
        """The killCursors of the cursor a getMore is waiting on, changing nothing (``None``:
        no getMore in flight, or a load-balanced cursor that lives on its one connection).

        A close from another thread or task sends it on a connection of its own, so the
        server interrupts the getMore at once (``CursorKilled``) instead of after its await.
        """
        cursor = self._cursor
        if self._state.flight is not Act.GETMORE or cursor is None or cursor.load_balanced:
            return None
        return kill_command(cursor.id, cursor.collection, cursor.database, cursor.address)

    def request_close(self) -> None:
        """A close is coming from aside (another thread or task; only a flag): the getMore
        :meth:`in_flight_kill` interrupts then fails (``CursorKilled``, or ``CursorNotFound``,
        which looks resumable) and closes the stream, never resumes it."""
        self._close_requested = True

    @property
    def busy(self) -> bool:
        """An operation is in progress."""
        return self._state.op is not None

    # -- operations -------------------------------------------------------------
    def start(self) -> None:
        """Begin the initial aggregate (``watch()``)."""
        self._fire(Event.START)

    def begin_next(self) -> None:
        """Begin a blocking ``next``: getMore until a document arrives or the stream dies."""
        self._asking()
        self._fire(Event.NEXT)

    def begin_try_next(self) -> None:
        """Begin ``try_next``: at most one getMore; after a resume only the new first batch."""
        self._asking()
        self._fire(Event.TRY_NEXT)

    def _asking(self) -> None:
        """The caller is back for more: the last event is handled (see :attr:`position`)."""
        self._handling = None
        if not self._batch:
            self._asked_at = self.clock()

    def close(self) -> None:
        """Begin closing: kill the server cursor (if any). Allowed between commands."""
        self._fire(Event.CLOSE)

    def abandon(self) -> KillCursors | None:
        """The stream is being dropped unclosed (garbage collected): close without I/O.

        Returns the killCursors for the open server cursor, if any, for the shell
        to hand to a background cleaner (a finaliser must not block on the
        network). A command still in flight is left to its own shell.
        """
        action = self._fire(Event.ABANDON)
        return action if isinstance(action, KillCursors) else None

    def abort(self) -> None:
        """Close after the shell was interrupted mid-command (KeyboardInterrupt, cancellation).

        The cursor is killed, the stream closes, the resume token stays readable.
        """
        self._fire(Event.ABORT)

    def next_action(self) -> Action:
        """What the shell must do next for the current operation."""
        while True:
            action = self._fire(*self._wanted())
            if action is not None:
                return action

    def next_buffered(self) -> Any:
        """Fast path for shells: the next buffered document, or :data:`NOT_BUFFERED`.

        Same result as a ``next``/``try_next`` operation that delivers a buffered
        document, without building an action per event. It covers only the plain
        case (no operation in progress, not the last document of the batch, no
        split-event reassembly, a token and a successful decode); everything else,
        including the postBatchResumeToken and errors, is left to the operation.
        There the table's NEXT, ACT_BUFFERED and DOCUMENT leave the control state
        as it was and only cache the token (``tests/client/test_states.py``
        checks it), so this path changes data only.
        """
        batch = self._batch
        if len(batch) < 2 or self._state.op is not None or self._fragments is not None:
            return NOT_BUFFERED
        event = batch[0]
        decode = self._decode
        try:
            if (type(event) is RawBSONDocument and type(event.raw) is bytes
                    and token_in_raw_event(event.raw)):
                token = IN_EVENT  # event_token's usual case, inline: this runs per event
            elif type(event) is dict:
                token = event["_id"]
                if type(token) is not dict or type(token.get("_data")) is not str:
                    return NOT_BUFFERED
            else:
                token = event_token(event)
            delivered = event if decode is None else decode(event)
        except Exception:
            return NOT_BUFFERED  # the operation re-reads the event and fails the stream
        batch.popleft()
        if token is IN_EVENT:
            self._token_event = event  # type: ignore[assignment]
        else:
            self._token, self._token_event = token, None
        self._use_start_after = False
        return delivered

    def receive_reply(self, reply: Mapping[str, Any], info: ReplyInfo) -> None:
        """Feed the successful reply of the in-flight command."""
        flight = self._state.flight
        if flight is Act.KILL_CURSORS:
            self._fire(Event.KILLED)
            return
        aggregate = flight in AGGREGATES
        server_time = self._server_time
        try:
            if isinstance(reply, Mapping):
                server_time = newest_reply_time(reply, server_time)
            read = self._read_reply(reply, info, server_time, aggregate=aggregate)
        except ChangeStreamError as exc:
            self._fire(Event.BAD_REPLY, _Reply(server_time), exc)
            return
        except Exception as exc:  # a reply shape the checks above did not foresee
            name = "aggregate" if aggregate else "getMore"
            error = MalformedReplyError(
                f"malformed {name} reply ({exc!r}): {describe(reply, 300)}", field="reply",
                value=reply,
            )
            self._fire(Event.BAD_REPLY, _Reply(server_time), error)
            return
        self._reply_at = now = self.clock()
        if server_time != self._server_time or self._server_seen_at is None:
            self._server_seen_at = now
        self._empty_getmore = not aggregate and not read.batch
        self._handling = None
        self._fire(Event.REPLY if read.cursor_id else Event.FINAL_REPLY, read)

    def receive_error(self, error: ErrorInfo) -> None:
        """Feed the failure of the in-flight command."""
        error = self._explained(error)
        flight = self._state.flight
        if flight is Act.KILL_CURSORS:
            event = Event.KILLED  # spec: errors while killing the cursor are suppressed
        elif flight is Act.GETMORE:
            event = Event.CLOSING_ERROR if self._close_requested else self._getmore_error_event(error)
        else:
            event = self._aggregate_error_event(error)
        self._fire(event, None, error.exception)

    def _explained(self, error: ErrorInfo) -> ErrorInfo:
        """``error`` whose fix is one of this client's options, saying which (codes unchanged)."""
        return explained(
            error, self._spec.options, joins_fragments=self._fragments is not None,
            adds_split_stage=bool(self._split_stage),
            opens_from_token=self._state.flight in AGGREGATES
            and self._opening_token(resume=self._state.flight in RESUMES) is not None,
        )

    def _opening_token(self, *, resume: bool) -> tuple[str, Mapping[str, Any]] | None:
        """The start option and token an aggregate opens from (``None``: no token). A resume
        sends the cached token (unchanged while it runs), the initial aggregate the caller's
        options (startAfter first, as :func:`start_options` sends them)."""
        if resume:
            token = self.resume_token
            option = "startAfter" if self._use_start_after else "resumeAfter"
        else:
            options = self._spec.options
            token = options.start_after if options.start_after is not None else options.resume_after
            option = "startAfter" if options.start_after is not None else "resumeAfter"
        return (option, token) if isinstance(token, Mapping) else None

    # -- classification ---------------------------------------------------------
    is_resumable = staticmethod(is_resumable)
    """Spec "Resumable Error" (:func:`changestream._error_rules.is_resumable`)."""

    def is_retryable_read(self, error: ErrorInfo) -> bool:
        """Retryable-reads spec: may a failed aggregate be retried once?"""
        return is_retryable_read(error, retry_reads=self._spec.retry_reads)

    def _aggregate_error_event(self, error: ErrorInfo) -> Event:
        """An aggregate's error, by the retryable-reads spec (the table: retry once or fail)."""
        if self.is_retryable_read(error):
            return Event.RETRYABLE_ERROR
        return Event.TIMEOUT if error.is_timeout else Event.ERROR

    def _getmore_error_event(self, error: ErrorInfo) -> Event:
        """A getMore's error, by the spec's resumability (the table: resume, wait, or fail)."""
        if error.is_timeout:
            return Event.TIMEOUT
        if not self.is_resumable(error):
            return Event.ERROR
        if self._idle_resumes >= MAX_IDLE_RESUMES:
            return Event.FRUITLESS_RESUMABLE_ERROR
        if error.is_network and self._cursor is not None and self._cursor.load_balanced:
            return Event.CURSOR_LOST
        return Event.RESUMABLE_ERROR

    # -- the one place control state changes --------------------------------------
    def _fire(self, event: Event, arg: Any = None, error: BaseException | None = None) -> Action | None:
        """Look ``event`` up in the table, take its state, apply its effects; the action, if any.

        ``arg`` is the event's data (a read reply, a delivered document and its
        token), ``error`` the exception it carries. An effect may report what it
        found (the document taken, a malformed field) as the next event; the first
        that does ends the effects (a refused reply loads nothing after it).
        """
        while True:
            outcome = transition(self._state, event)
            self._state = outcome.state
            follow_up = None
            for effect in outcome.effects:
                follow_up = _EFFECTS[effect](self, arg, error)
                if follow_up is not None:
                    break  # what it found is the next event: the rest do not apply
            if outcome.act is not None:
                return self._build(outcome.act, arg)
            if follow_up is None:
                return None
            event, arg, error = follow_up

    def _wanted(self) -> tuple[Event, Any, BaseException | None]:
        """``next_action`` as an event: what the buffer holds decides which."""
        if self._batch:
            return Event.ACT_BUFFERED, None, None
        if self._fragments is not None and self._fragments.pending:
            return (Event.ACT_MID_SPLIT, None,
                    SplitEventError("the cursor closed in the middle of a split event"))
        return Event.ACT, None, None

    def _build(self, act: Act, arg: Any) -> Action:
        """The action the table's act stands for."""
        if act is Act.DELIVER:
            return Deliver(arg[0])
        if act is Act.NO_DOCUMENT:
            return NoDocument()
        if act is Act.RAISE:
            error, self._error = self._error, None
            assert error is not None
            return Raise(error)
        if act is Act.GETMORE:
            return self._getmore()
        if act is Act.KILL_CURSORS:
            return self._kill()
        command = self._aggregate(is_resume=act in RESUMES)
        if act is Act.RETRY_AGGREGATE or act is Act.RETRY_RESUME:
            return dataclasses.replace(command, attempt=2)
        return command

    # -- effects (data only; the table says when) -----------------------------------------------
    def _note_server_time(self, read: _Reply, error: BaseException | None) -> None:
        self._server_time = read.server_time

    def _store_cursor(self, read: _Reply, error: BaseException | None) -> None:
        assert read.info is not None
        info = read.info
        self._cursor = _Cursor(read.cursor_id, read.database, read.collection, info.address,
                               info.wire_version, info.load_balanced)

    def _update_cursor(self, read: _Reply, error: BaseException | None) -> None:
        assert self._cursor is not None
        self._cursor.id = read.cursor_id

    def _reset_idle(self, arg: Any, error: BaseException | None) -> None:
        self._idle_resumes = 0

    def _load_batch(self, read: _Reply, error: BaseException | None) -> None:
        if read.batch:
            self._idle_resumes = 0
        self._batch = read.batch
        self._post_batch_token = post_batch_token = read.post_batch_token
        pending = self._fragments is not None and self._fragments.pending
        if not self._batch and post_batch_token is not None and not pending:
            self._token, self._token_event = post_batch_token, None

    def _save_operation_time(
        self, read: _Reply, error: BaseException | None
    ) -> tuple[Event, Any, BaseException | None] | None:
        """Spec: keep the initial aggregate's operationTime when nothing else can resume."""
        options = self._spec.options
        reply = read.document
        assert reply is not None and read.info is not None
        if (
            not read.batch
            and read.post_batch_token is None
            and options.start_at_operation_time is None
            and options.resume_after is None
            and options.start_after is None
            and read.info.wire_version >= 7
            and reply.get("operationTime") is not None
        ):
            operation_time = reply["operationTime"]
            if not isinstance(operation_time, Timestamp):
                return Event.FAIL, None, MalformedReplyError(
                    f"malformed aggregate reply: operationTime must be a timestamp, not "
                    f"{describe(operation_time)}", field="operationTime", value=operation_time,
                )
            self._operation_time = operation_time
        return None

    def _check_start_token(
        self, read: _Reply, error: BaseException | None
    ) -> tuple[Event, Any, BaseException | None] | None:
        """The initial aggregate's start token ahead of the server's cluster time: warned of,
        or refused (:func:`check_start_token`); the table then kills the new cursor."""
        opening = self._opening_token(resume=False)
        if opening is None:
            return None
        assert read.document is not None
        try:
            check_start_token(*opening, read.document, self._namespace())
        except ChangeStreamError as exc:
            return Event.FAIL, None, exc
        return None

    def _drop_cursor(self, arg: Any, error: BaseException | None) -> None:
        self._cursor = None

    def _clear_buffer(self, arg: Any, error: BaseException | None) -> None:
        self._batch.clear()
        if self._fragments is not None:
            self._fragments.reset()

    def _begin_resume(self, arg: Any, cause: BaseException | None) -> None:
        """Spec "Resume Process": count and log it, drop what the old cursor buffered."""
        self._resumes += 1
        if log.isEnabledFor(logging.INFO):
            position = self.position
            log.info(
                "resuming the change stream on %s (resume %d, after %s) from %s",
                self._namespace(), self._resumes,
                "a client-side timeout" if cause is None else describe_error(cause),
                "no token" if position.token_time is None
                else f"the token at cluster time {position.token_time}",
            )
        self._batch.clear()
        self._post_batch_token = None
        if self._fragments is not None:
            self._fragments.reset()
        self._idle_resumes += 1

    def _take_document(
        self, arg: Any, error: BaseException | None
    ) -> tuple[Event, Any, BaseException | None]:
        """Take one buffered document; what it is (event, last of the batch, fragment, bad) is the next event."""
        document = self._batch.popleft()
        last_in_batch = not self._batch
        if not isinstance(document, Mapping):
            return Event.FAIL, None, not_an_event(document)
        event: Mapping[str, Any] | None = document
        if self._fragments is not None:
            try:
                event = self._fragments.add(document)
            except SplitEventError as exc:
                return Event.FAIL, None, exc
            if event is None:
                return Event.FRAGMENT, None, None
        assert event is not None
        try:
            token = event_token(event)
        except KeyError:
            return Event.FAIL, None, MissingResumeTokenError()
        except ChangeStreamError as exc:
            return Event.FAIL, None, exc
        except Exception as exc:  # e.g. InvalidBSON from a raw event
            return Event.FAIL, None, MalformedReplyError(
                f"a change event's _id cannot be read ({exc!r})", field="_id", value=event,
            )
        try:
            delivered = event if self._decode is None else self._decode(event)
        except Exception as exc:
            return Event.FAIL, None, exc
        taken = (delivered, token, event)
        return (Event.LAST_DOCUMENT if last_in_batch else Event.DOCUMENT), taken, None

    def _cache_token(self, taken: tuple[Any, Any, Mapping[str, Any]],
                     error: BaseException | None) -> None:
        """The event's ``_id`` (a raw event's is sliced out only when used)."""
        _, token, event = taken
        if token is IN_EVENT:
            self._token_event = event  # type: ignore[assignment]
        else:
            self._token, self._token_event = token, None
        self._use_start_after = False

    def _cache_last_token(self, taken: tuple[Any, Any, Mapping[str, Any]],
                          error: BaseException | None) -> None:
        """Spec: last document of the batch -> postBatchResumeToken, else its _id."""
        if self._post_batch_token is None:
            self._cache_token(taken, error)
            return
        self._token, self._token_event = self._post_batch_token, None
        self._use_start_after = False
        self._handling = taken

    def _keep_error(self, arg: Any, error: BaseException | None) -> None:
        assert error is not None
        self._error = error

    # -- reading replies and building commands ----------------------------------
    def _read_reply(self, reply: Mapping[str, Any], info: ReplyInfo,
                    server_time: Timestamp | None, *, aggregate: bool) -> _Reply:
        """Check a reply's shape before anything of it is used (fields named on errors)."""
        if not aggregate:
            _, batch, cursor_id, post_batch_token = parse_cursor(reply, "nextBatch", "getMore")
            return _Reply(server_time, info, reply, batch, cursor_id,
                          post_batch_token=post_batch_token)
        cursor, batch, cursor_id, post_batch_token = parse_cursor(reply, "firstBatch", "aggregate")
        ns = cursor.get("ns") or f"{self._spec.database}.{self._spec.collection or '$cmd.aggregate'}"
        if not isinstance(ns, str):
            raise MalformedReplyError(f"malformed aggregate reply: cursor.ns must be a string, not "
                                      f"{describe(ns)}", field="cursor.ns", value=ns)
        database, _, collection = ns.partition(".")
        return _Reply(server_time, info, reply, batch, cursor_id, database, collection,
                      post_batch_token)


    def _namespace(self) -> str:
        spec = self._spec
        if spec.cluster:
            return "the cluster"
        return spec.database if spec.collection is None else f"{spec.database}.{spec.collection}"

    def _kill(self) -> KillCursors:
        """The killCursors of the current cursor, which is then forgotten."""
        cursor = self._cursor
        assert cursor is not None
        self._cursor = None
        return kill_command(cursor.id, cursor.collection, cursor.database, cursor.address)

    def _aggregate(self, *, is_resume: bool) -> RunAggregate:
        start = self._resume_options() if is_resume else start_options(self._spec.options)
        return aggregate_command(self._spec, start, self._split_stage, is_resume=is_resume)

    def _resume_options(self) -> dict[str, Any]:
        """Spec "Resume Process": startAfter vs resumeAfter vs startAtOperationTime."""
        token = self.resume_token
        if token is not None:
            key = "startAfter" if self._use_start_after else "resumeAfter"
            return {key: token}
        if self._operation_time is not None:
            return {"startAtOperationTime": self._operation_time}
        return {}

    def _getmore(self) -> RunGetMore:
        cursor = self._cursor
        assert cursor is not None
        return getmore_command(cursor.id, cursor.collection, cursor.database, cursor.address,
                               cursor.wire_version, self._spec.options)


_EFFECTS: Final[Mapping[Effect, _Effector]] = {
    Effect.NOTE_SERVER_TIME: ChangeStreamMachine._note_server_time,
    Effect.STORE_CURSOR: ChangeStreamMachine._store_cursor,
    Effect.UPDATE_CURSOR: ChangeStreamMachine._update_cursor,
    Effect.RESET_IDLE: ChangeStreamMachine._reset_idle,
    Effect.LOAD_BATCH: ChangeStreamMachine._load_batch,
    Effect.CHECK_START_TOKEN: ChangeStreamMachine._check_start_token,
    Effect.SAVE_OPERATION_TIME: ChangeStreamMachine._save_operation_time,
    Effect.DROP_CURSOR: ChangeStreamMachine._drop_cursor,
    Effect.CLEAR_BUFFER: ChangeStreamMachine._clear_buffer,
    Effect.BEGIN_RESUME: ChangeStreamMachine._begin_resume,
    Effect.TAKE_DOCUMENT: ChangeStreamMachine._take_document,
    Effect.CACHE_TOKEN: ChangeStreamMachine._cache_token,
    Effect.CACHE_LAST_TOKEN: ChangeStreamMachine._cache_last_token,
    Effect.KEEP_ERROR: ChangeStreamMachine._keep_error,
}
"""How the machine applies each of the table's effects."""
