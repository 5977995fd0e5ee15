"""The change-stream machine's control state and every transition, in one table.

As in h11's ``_state.py``, what the machine may do next is decided in one
place. The control state is one frozen :class:`State` record: the stream's
:class:`Phase`, the caller's operation (:class:`Op`), the command in flight,
the *plan* (what ``next_action`` returns next, in order, before the machine
decides anew: e.g. killCursors, then the resume aggregate), the server cursor
as far as control goes (:class:`Cursor`) and the operation's getMore budget.

:func:`transition` maps ``(state, event)`` to a :class:`Transition`: the next
state, the effects (:class:`Effect`) on the machine's data (buffer, tokens,
counters) and the :class:`Act` that ``next_action`` returns, if any.
:class:`~changestream._machine.ChangeStreamMachine` translates every input
(a caller's call, a reply, an error, what it found in its buffer) into an
:class:`Event`, looks it up here and applies the outcome; it changes no
control state anywhere else. A pair the table does not allow is a bug in the
machine or its shell and raises :class:`TransitionError` at once.

The machine picks an event from its *data* (is a document buffered, is the
error resumable by the spec, did resuming bring nothing several times); this
table picks what the event means from the *state* (which command failed, is a
cursor open, which operation runs).

``docs/resumability.md`` shows :func:`mermaid` (the phases and the events that
move between them) and :func:`markdown` (every reachable transition), both
drawn from :func:`reachable`, which explores this table; a test keeps the docs
equal to them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator

__all__ = [
    "AGGREGATES",
    "COMMANDS",
    "INITIAL",
    "RESUMES",
    "Act",
    "Cursor",
    "Effect",
    "Event",
    "Op",
    "Phase",
    "State",
    "Transition",
    "TransitionError",
    "markdown",
    "mermaid",
    "reachable",
    "transition",
]


class _Fast(enum.Enum):
    """Members hash by identity (as they compare): the table is looked up on every event."""

    __hash__ = object.__hash__


class Phase(_Fast):
    """Where the stream is in its life (what ``alive`` and the diagram show)."""

    NEW = "new"
    """Before the initial aggregate succeeded."""
    OPEN = "open"
    """A server cursor (or its final buffered batch) exists."""
    RESUME_PENDING = "resume pending"
    """The cursor is unusable (resumable error or timeout); the next step is a resume."""
    CLOSED = "closed"
    """Closed, invalidated, exhausted or failed: nothing more is returned."""


class Op(_Fast):
    """The caller's operation in progress (``None`` in :class:`State`: idle)."""

    START = "start"
    NEXT = "next"
    TRY_NEXT = "try_next"
    CLOSE = "close"


class Cursor(_Fast):
    """The server cursor as far as control goes (its id, namespace and server are data)."""

    NONE = "none"
    """No cursor: not opened yet, killed, or lost with its load-balanced connection."""
    LIVE = "live"
    """Open on the server: getMore may run on it, and it must be killed when left."""
    DONE = "done"
    """Cursor id 0 (exhausted or invalidated): what is buffered is all there is."""


class Act(_Fast):
    """What ``next_action`` returns: a command for the shell to run, or the operation's result."""

    AGGREGATE = "aggregate"
    RETRY_AGGREGATE = "aggregate (retry)"
    """The retryable-reads retry (attempt 2) of the initial aggregate."""
    RESUME = "resume aggregate"
    RETRY_RESUME = "resume aggregate (retry)"
    GETMORE = "getMore"
    KILL_CURSORS = "killCursors"
    DELIVER = "deliver"
    NO_DOCUMENT = "no document"
    RAISE = "raise"


COMMANDS = frozenset({Act.AGGREGATE, Act.RETRY_AGGREGATE, Act.RESUME, Act.RETRY_RESUME,
                      Act.GETMORE, Act.KILL_CURSORS})
"""The acts the shell runs (and feeds back exactly one outcome of)."""
AGGREGATES = frozenset({Act.AGGREGATE, Act.RETRY_AGGREGATE, Act.RESUME, Act.RETRY_RESUME})
"""The acts that open a cursor (an ``aggregate`` command)."""
RESUMES = frozenset({Act.RESUME, Act.RETRY_RESUME})
"""The acts that reopen a cursor after an error (the aggregate carries the resume token)."""
_RETRY = {Act.AGGREGATE: Act.RETRY_AGGREGATE, Act.RESUME: Act.RETRY_RESUME}
_ITERATING = frozenset({Op.NEXT, Op.TRY_NEXT})


class Effect(_Fast):
    """A change to the machine's data (not control state), made when the table says."""

    NOTE_SERVER_TIME = "note the reply's cluster time"
    STORE_CURSOR = "keep the new cursor (id, namespace, server)"
    UPDATE_CURSOR = "update the cursor id"
    RESET_IDLE = "reset the fruitless-resume count"
    LOAD_BATCH = "buffer the batch and its postBatchResumeToken"
    CHECK_START_TOKEN = "check the start token against the server's clock (initial aggregate)"
    SAVE_OPERATION_TIME = "save operationTime (initial aggregate, spec rules)"
    DROP_CURSOR = "forget the cursor"
    CLEAR_BUFFER = "drop buffered documents and split fragments"
    BEGIN_RESUME = "count and log the resume, drop the buffer"
    TAKE_DOCUMENT = "take one buffered document"
    CACHE_TOKEN = "cache the event's token"
    CACHE_LAST_TOKEN = "cache the postBatchResumeToken, else the event's token"
    KEEP_ERROR = "keep the error to raise"


_FOLLOW_UP_EFFECTS = frozenset({Effect.TAKE_DOCUMENT, Effect.CHECK_START_TOKEN,
                                Effect.SAVE_OPERATION_TIME})
"""Effects whose application may produce the next event (what the document or reply was);
the first one that does ends the transition's effects (the rest are not applied)."""


class Event(_Fast):
    """Everything that happens to the machine (the labels of the diagram)."""

    # The caller.
    START = "start()"
    NEXT = "next()"
    TRY_NEXT = "try_next()"
    CLOSE = "close()"
    ABORT = "abort (interrupted mid-command)"
    ABANDON = "abandon (garbage collected)"
    # next_action(): what the machine finds in its buffer.
    ACT = "next_action()"
    """Nothing buffered."""
    ACT_BUFFERED = "next_action(), buffered"
    """A document is buffered."""
    ACT_MID_SPLIT = "next_action(), mid split event"
    """Nothing buffered, but fragments of a split event wait for the rest."""
    # A buffered document was taken (after Effect.TAKE_DOCUMENT).
    DOCUMENT = "event"
    LAST_DOCUMENT = "last event of the batch"
    FRAGMENT = "fragment of a split event"
    # The outcome of the command in flight.
    REPLY = "reply"
    """A well-formed reply; the cursor stays open."""
    FINAL_REPLY = "reply, cursor id 0"
    """A well-formed reply whose cursor is exhausted or invalidated."""
    BAD_REPLY = "malformed reply"
    KILLED = "killCursors answered"
    """A killCursors reply or error (spec: its errors are suppressed)."""
    RETRYABLE_ERROR = "retryable error"
    """Of an aggregate: retryable-reads spec."""
    RESUMABLE_ERROR = "resumable error"
    """Of a getMore: the spec's "Resumable Error"."""
    FRUITLESS_RESUMABLE_ERROR = "resumable error, resumes fruitless"
    """A resumable error after ``MAX_IDLE_RESUMES`` resumes in a row brought nothing."""
    CURSOR_LOST = "network error, load-balanced"
    """A resumable network error behind a load balancer: the cursor died with the connection."""
    TIMEOUT = "client timeout"
    """The client-side operation timeout (CSOT) expired."""
    ERROR = "error"
    """Any other error of a command: not resumable, not retried."""
    CLOSING_ERROR = "getMore error after close requested"
    """A getMore's error after a close was requested from aside (its cursor killed under it:
    ``CursorKilled``, or ``CursorNotFound`` that looks resumable): closes, never resumes."""
    FAIL = "bad data"
    """The machine found an event, reply field or decode it cannot accept."""


@dataclasses.dataclass(frozen=True, slots=True)
class State:
    """The machine's whole control state; the table makes every new one."""

    phase: Phase = Phase.NEW
    op: Op | None = None
    """The caller's operation in progress (``None``: idle)."""
    flight: Act | None = None
    """The command the shell is running (one of :data:`COMMANDS`)."""
    plan: tuple[Act, ...] = ()
    """What ``next_action`` returns next, in order, before deciding anew."""
    cursor: Cursor = Cursor.NONE
    getmores: int | None = None
    """getMores the operation may still run (``try_next``: one); ``None``: no limit."""
    _memo: dict[Event, Transition] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False)
    """This state's row of the table, filled as events are looked up (see :func:`transition`)."""

    def __str__(self) -> str:
        parts = [f"phase {self.phase.value!r}"]
        parts.append("idle" if self.op is None else f"op {self.op.value!r}")
        if self.flight is not None:
            parts.append(f"{self.flight.value!r} in flight")
        if self.plan:
            parts.append("plan " + " -> ".join(act.value for act in self.plan))
        parts.append(f"cursor {self.cursor.value}")
        if self.getmores is not None:
            parts.append(f"{self.getmores} getMore(s) left")
        return ", ".join(parts)


INITIAL = State()
"""A new stream's state."""
_CANONICAL: dict[State, State] = {INITIAL: INITIAL}


@dataclasses.dataclass(frozen=True, slots=True)
class Transition:
    """What an event does: the next state, the effects on data, what ``next_action`` returns."""

    state: State
    effects: tuple[Effect, ...] = ()
    act: Act | None = None


class TransitionError(RuntimeError):
    """An event the table does not allow in the current state: a bug in the machine or its shell."""


def transition(state: State, event: Event) -> Transition:
    """The table: what ``event`` does in ``state`` (:class:`TransitionError` if it cannot happen).

    The rules are pure, so each pair is decided once and then read from the
    state's row; the states an outcome leads to are shared (one object per
    value), so the machine's next lookup is a dict hit too.
    """
    try:
        return state._memo[event]
    except KeyError:
        pass
    outcome = _RULES[event](state, event)
    target = _CANONICAL.setdefault(outcome.state, outcome.state)
    if target is not outcome.state:
        outcome = Transition(target, outcome.effects, outcome.act)
    state._memo[event] = outcome
    return outcome


def _refuse(state: State, event: Event, why: str) -> TransitionError:
    return TransitionError(f"change stream machine: {event.value!r} cannot happen ({why}); "
                           f"state: {state}")


def _replace(state: State, **changes: object) -> State:
    return dataclasses.replace(state, **changes)  # type: ignore[arg-type]


def _ended(state: State, **changes: object) -> State:
    """The operation is over: idle again."""
    return _replace(state, op=None, getmores=None, **changes)


# -- rules, one per event -----------------------------------------------------------------------
def _start(s: State, e: Event) -> Transition:
    if s.phase is not Phase.NEW or s.op is not None:
        raise _refuse(s, e, "start() runs once, before any other operation")
    return Transition(_replace(s, op=Op.START))


def _begin(s: State, e: Event) -> Transition:
    if s.op is not None:
        raise _refuse(s, e, f"an operation ({s.op.value}) is already in progress")
    if s.phase is Phase.NEW:
        raise _refuse(s, e, "start() must succeed before iterating")
    if e is Event.TRY_NEXT:
        # try_next: at most one getMore; after a resume only the new first batch.
        return Transition(_replace(s, op=Op.TRY_NEXT, getmores=1))
    return Transition(_replace(s, op=Op.NEXT, getmores=None))


def _close(s: State, e: Event) -> Transition:
    if s.flight is not None:
        raise _refuse(s, e, "feed the outcome of the in-flight command before close()")
    plan = (Act.KILL_CURSORS, Act.NO_DOCUMENT) if s.cursor is Cursor.LIVE else (Act.NO_DOCUMENT,)
    closed = State(Phase.CLOSED, Op.CLOSE, None, plan, s.cursor, None)
    return Transition(closed, (Effect.CLEAR_BUFFER,))


def _abort(s: State, e: Event) -> Transition:
    """Interrupted mid-command: forget the command in flight, then close."""
    return _close(_replace(s, flight=None), Event.CLOSE)


def _abandon(s: State, e: Event) -> Transition:
    """Garbage collected: close without I/O; the open cursor's killCursors goes to a cleaner."""
    if s.flight is not None:
        return Transition(s)  # left to the shell running it
    closed = State(Phase.CLOSED, cursor=Cursor.NONE)
    if s.cursor is Cursor.LIVE:
        return Transition(closed, (Effect.CLEAR_BUFFER,), Act.KILL_CURSORS)
    return Transition(closed, (Effect.CLEAR_BUFFER, Effect.DROP_CURSOR))


def _pop(s: State, effects: tuple[Effect, ...] = ()) -> Transition:
    """Run the plan's next step: a command goes in flight, a result ends the operation."""
    act, rest = s.plan[0], s.plan[1:]
    if act in COMMANDS:
        cursor = Cursor.NONE if act is Act.KILL_CURSORS else s.cursor
        return Transition(_replace(s, flight=act, plan=rest, cursor=cursor), effects, act)
    assert not rest, "a result ends the plan"
    return Transition(_ended(s, plan=rest), effects, act)


def _resume(s: State) -> tuple[State, tuple[Effect, ...]]:
    """Spec "Resume Process": kill the old cursor on its server, then aggregate."""
    if s.cursor is Cursor.LIVE:
        return _replace(s, plan=(Act.KILL_CURSORS, Act.RESUME)), (Effect.BEGIN_RESUME,)
    state = _replace(s, plan=(Act.RESUME,), cursor=Cursor.NONE)
    return state, (Effect.BEGIN_RESUME, Effect.DROP_CURSOR)


def _fail(s: State, *effects: Effect) -> Transition:
    """Close the stream (killing its cursor first) and raise the error."""
    plan = (Act.KILL_CURSORS, Act.RAISE) if s.cursor is Cursor.LIVE else (Act.RAISE,)
    closed = _replace(s, phase=Phase.CLOSED, flight=None, plan=plan)
    return Transition(closed, (*effects, Effect.CLEAR_BUFFER, Effect.KEEP_ERROR))


def _act(s: State, e: Event) -> Transition:
    if s.flight is not None:
        raise _refuse(s, e, "feed the outcome of the in-flight command first")
    if s.op is None:
        raise _refuse(s, e, "no operation in progress")
    if s.plan:
        return _pop(s)
    if s.op is Op.START and s.phase is Phase.NEW:
        return Transition(_replace(s, flight=Act.AGGREGATE), (), Act.AGGREGATE)
    if s.op not in _ITERATING:
        raise _refuse(s, e, f"{s.op.value} has nothing left to do")
    if s.phase is Phase.CLOSED:
        return Transition(_ended(s), (), Act.NO_DOCUMENT)
    if s.phase is Phase.RESUME_PENDING:
        state, effects = _resume(s)
        return _pop(state, effects)
    if s.phase is not Phase.OPEN or s.cursor is Cursor.NONE:
        raise _refuse(s, e, "an open stream needs its cursor")
    if e is Event.ACT_BUFFERED:
        return Transition(s, (Effect.TAKE_DOCUMENT,))
    if s.cursor is Cursor.DONE:
        # Exhausted or invalidated, and everything buffered was returned.
        if e is Event.ACT_MID_SPLIT:
            failed = _fail(s)  # the cursor closed in the middle of a split event
            return _pop(failed.state, failed.effects)
        return Transition(_ended(s, phase=Phase.CLOSED), (Effect.CLEAR_BUFFER,), Act.NO_DOCUMENT)
    if s.getmores == 0:
        return Transition(_ended(s), (), Act.NO_DOCUMENT)
    getmores = None if s.getmores is None else s.getmores - 1
    return Transition(_replace(s, flight=Act.GETMORE, getmores=getmores), (), Act.GETMORE)


def _taken(s: State, e: Event) -> Transition:
    """What the document taken by Effect.TAKE_DOCUMENT turned out to be."""
    if (s.op not in _ITERATING or s.phase is not Phase.OPEN or s.flight is not None or s.plan
            or s.cursor is Cursor.NONE):
        raise _refuse(s, e, "only a next/try_next on an open stream takes buffered documents")
    if e is Event.FRAGMENT:
        return Transition(s)  # keep the token before the first fragment: a resume re-delivers it
    if e is Event.DOCUMENT:
        return Transition(_ended(s), (Effect.CACHE_TOKEN,), Act.DELIVER)
    # Spec: last document of the batch -> postBatchResumeToken, else its _id.
    if s.cursor is Cursor.DONE:
        closed = _ended(s, phase=Phase.CLOSED)
        return Transition(closed, (Effect.CACHE_LAST_TOKEN, Effect.CLEAR_BUFFER), Act.DELIVER)
    return Transition(_ended(s), (Effect.CACHE_LAST_TOKEN,), Act.DELIVER)


def _reply(s: State, e: Event) -> Transition:
    flight = s.flight
    if flight is None or flight is Act.KILL_CURSORS:
        raise _refuse(s, e, "no aggregate or getMore is in flight")
    cursor = Cursor.LIVE if e is Event.REPLY else Cursor.DONE
    if flight is Act.GETMORE:
        if s.phase is not Phase.OPEN:
            raise _refuse(s, e, f"a getMore cannot be in flight in phase {s.phase.value!r}")
        state = _replace(s, flight=None, cursor=cursor)
        return Transition(state, (Effect.NOTE_SERVER_TIME, Effect.UPDATE_CURSOR, Effect.RESET_IDLE,
                               Effect.LOAD_BATCH))
    resume = flight in RESUMES
    if s.phase is not (Phase.RESUME_PENDING if resume else Phase.NEW):
        raise _refuse(s, e, f"a {flight.value} cannot be in flight in phase {s.phase.value!r}")
    plan = (Act.NO_DOCUMENT,) if s.op is Op.START else ()
    state = _replace(s, phase=Phase.OPEN, flight=None, plan=plan, cursor=cursor)
    if resume:  # the server echoed the token a resume sent: nothing to check
        return Transition(state, (Effect.NOTE_SERVER_TIME, Effect.STORE_CURSOR, Effect.LOAD_BATCH))
    # A refused start token or a malformed operationTime fails the stream: both come after
    # STORE_CURSOR, so the new cursor is killed then; a refused token stops the effects before
    # LOAD_BATCH, so the caller's token stays the cached one.
    return Transition(state, (Effect.NOTE_SERVER_TIME, Effect.STORE_CURSOR,
                              Effect.CHECK_START_TOKEN, Effect.LOAD_BATCH,
                              Effect.SAVE_OPERATION_TIME))


def _bad_reply(s: State, e: Event) -> Transition:
    if s.flight is None or s.flight is Act.KILL_CURSORS:
        raise _refuse(s, e, "no aggregate or getMore is in flight")
    return _fail(s, Effect.NOTE_SERVER_TIME)


def _killed(s: State, e: Event) -> Transition:
    if s.flight is not Act.KILL_CURSORS or not s.plan:
        raise _refuse(s, e, "no killCursors is in flight")
    return Transition(_replace(s, flight=None))


def _error(s: State, e: Event) -> Transition:
    flight = s.flight
    if flight is None or flight is Act.KILL_CURSORS:
        raise _refuse(s, e, "no aggregate or getMore is in flight")
    if flight is Act.GETMORE:
        return _getmore_error(s, e)
    if e is Event.CLOSING_ERROR:
        raise _refuse(s, e, "only a getMore is interrupted by a close from aside")
    if e is Event.RETRYABLE_ERROR and flight in _RETRY:
        # Retryable reads: one more attempt of the same aggregate.
        return Transition(_replace(s, flight=None, plan=(_RETRY[flight],)))
    if e is Event.TIMEOUT and flight in RESUMES:
        # CSOT: a timeout never invalidates the stream; the next call resumes again.
        return Transition(_replace(s, flight=None, plan=(Act.RAISE,)), (Effect.KEEP_ERROR,))
    if e in (Event.RETRYABLE_ERROR, Event.TIMEOUT, Event.ERROR):
        return _fail(s)  # spec: an aggregate error is never resumable
    raise _refuse(s, e, "aggregate errors are classified by the retryable-reads spec")


def _getmore_error(s: State, e: Event) -> Transition:
    if e is Event.ERROR:
        return _fail(s)
    if e is Event.CLOSING_ERROR:
        # The close asked for is what happened: no resume, no error; a cursor the kill aside
        # may have missed is killed first.
        plan = (Act.KILL_CURSORS, Act.NO_DOCUMENT) if s.cursor is Cursor.LIVE else (Act.NO_DOCUMENT,)
        closed = _replace(s, phase=Phase.CLOSED, flight=None, plan=plan, getmores=None)
        return Transition(closed, (Effect.CLEAR_BUFFER,))
    if e is Event.RETRYABLE_ERROR:
        raise _refuse(s, e, "getMore errors are classified by resumability")
    pending = _replace(s, phase=Phase.RESUME_PENDING, flight=None)
    if e in (Event.TIMEOUT, Event.FRUITLESS_RESUMABLE_ERROR):
        # CSOT: keep the stream; the next call resumes before any getMore. Fruitless
        # resumes: no hot loop; the caller decides when to try again (it resumes once).
        return Transition(_replace(pending, plan=(Act.RAISE,)), (Effect.KEEP_ERROR,))
    if s.op is Op.TRY_NEXT:
        pending = _replace(pending, getmores=0)  # after a resume only the new first batch
    if e is Event.CURSOR_LOST:
        # Load-balancers spec: the cursor died with its connection; no killCursors.
        pending = _replace(pending, cursor=Cursor.NONE)
    return Transition(*_resume(pending))


def _bad_data(s: State, e: Event) -> Transition:
    if s.op is None or s.flight is not None or s.phase is not Phase.OPEN:
        raise _refuse(s, e, "bad data is found only in a reply or document of an open stream")
    return _fail(s)


_RULES = {
    Event.START: _start,
    Event.NEXT: _begin,
    Event.TRY_NEXT: _begin,
    Event.CLOSE: _close,
    Event.ABORT: _abort,
    Event.ABANDON: _abandon,
    Event.ACT: _act,
    Event.ACT_BUFFERED: _act,
    Event.ACT_MID_SPLIT: _act,
    Event.DOCUMENT: _taken,
    Event.LAST_DOCUMENT: _taken,
    Event.FRAGMENT: _taken,
    Event.REPLY: _reply,
    Event.FINAL_REPLY: _reply,
    Event.BAD_REPLY: _bad_reply,
    Event.KILLED: _killed,
    Event.RETRYABLE_ERROR: _error,
    Event.RESUMABLE_ERROR: _error,
    Event.FRUITLESS_RESUMABLE_ERROR: _error,
    Event.CURSOR_LOST: _error,
    Event.TIMEOUT: _error,
    Event.ERROR: _error,
    Event.CLOSING_ERROR: _error,
    Event.FAIL: _bad_data,
}
"""Which rule decides each event."""
_ACT_VARIANTS = frozenset({Event.ACT_BUFFERED, Event.ACT_MID_SPLIT})


# -- the table, explored (for the docs and the tests) -------------------------------------------
def reachable() -> Iterator[tuple[State, Event, Transition]]:
    """Every allowed ``(state, event) -> outcome`` from :data:`INITIAL`, breadth first."""
    seen, frontier = {INITIAL}, [INITIAL]
    while frontier:
        following: list[State] = []
        for state in frontier:
            for event in Event:
                try:
                    outcome = transition(state, event)
                except TransitionError:
                    continue
                yield state, event, outcome
                if outcome.state not in seen:
                    seen.add(outcome.state)
                    following.append(outcome.state)
        frontier = following


_DIAGRAM_LABELS = {
    Event.CLOSE: "close",
    Event.ABORT: "close",
    Event.ABANDON: "close",
    Event.REPLY: "aggregate ok",
    Event.FINAL_REPLY: "aggregate ok",
    Event.ACT: "cursor exhausted",
    Event.LAST_DOCUMENT: "cursor exhausted",
    Event.RESUMABLE_ERROR: "resumable error",
    Event.FRUITLESS_RESUMABLE_ERROR: "resumable error",
    Event.CURSOR_LOST: "resumable error",
    Event.RETRYABLE_ERROR: "retryable error",
    Event.TIMEOUT: "client timeout",
    Event.ERROR: "error",
    Event.CLOSING_ERROR: "close",
    Event.BAD_REPLY: "invalid reply or event",
    Event.FAIL: "invalid reply or event",
    Event.ACT_MID_SPLIT: "invalid reply or event",
}
"""The diagram groups events as users see them (the table under it has every event)."""
_SHOWN_SELF_LOOPS = frozenset({Event.RETRYABLE_ERROR, Event.TIMEOUT})
"""Errors shown where they keep the phase: they do not end the stream."""


def _phase_edges() -> dict[tuple[Phase, Phase], list[str]]:
    edges: dict[tuple[Phase, Phase], list[str]] = {}
    for state, event, outcome in sorted(reachable(), key=lambda row: list(Event).index(row[1])):
        source, target = state.phase, outcome.state.phase
        if source is target and event not in _SHOWN_SELF_LOOPS:
            continue
        label = _DIAGRAM_LABELS[event]
        if event is Event.RETRYABLE_ERROR:  # retried once; the retry's own error ends the stream
            label = "retryable error, retried once" if source is target else "error"
        labels = edges.setdefault((source, target), [])
        if label not in labels:
            labels.append(label)
    return edges


def mermaid() -> str:
    """The phases and what moves the stream between them, as a Mermaid state diagram."""
    names = {phase: phase.name.title().replace("_", "") for phase in Phase}
    lines = ["stateDiagram-v2", f"    [*] --> {names[Phase.NEW]}"]
    phases = list(Phase)
    edges = _phase_edges()
    for source, target in sorted(edges, key=lambda k: (phases.index(k[0]), phases.index(k[1]))):
        lines.append(f"    {names[source]} --> {names[target]}: {' / '.join(edges[source, target])}")
    lines.append(f"    {names[Phase.CLOSED]} --> [*]")
    return "\n".join(lines)


def markdown() -> str:
    """Every reachable transition as a Markdown table, grouped by event and phase."""
    rows: dict[tuple[Event, Phase, Phase], tuple[set[str], set[str]]] = {}
    for state, event, outcome in reachable():
        if event in _ACT_VARIANTS and transition(state, Event.ACT) == outcome:
            continue  # the buffer's content changes nothing here
        acts, effects = rows.setdefault((event, state.phase, outcome.state.phase), (set(), set()))
        if outcome.act is not None:
            acts.add(outcome.act.value)
        effects.update(effect.value for effect in outcome.effects)
    order, phases = list(Event), list(Phase)
    lines = ["| event | phase | next phase | next_action returns | data changes |",
             "|---|---|---|---|---|"]
    for event, source, target in sorted(
        rows, key=lambda k: (order.index(k[0]), phases.index(k[1]), phases.index(k[2]))
    ):
        acts, effects = rows[event, source, target]
        lines.append(f"| {event.value} | {source.value} | {target.value} | "
                     f"{', '.join(sorted(acts)) or '-'} | {'; '.join(sorted(effects)) or '-'} |")
    return "\n".join(lines)
