"""The machine's control state and transitions: one table, every listed transition, no other writer.

Three layers: the table itself (each rule's transitions as listed here, the
pairs it refuses, invariants over every reachable state), the docs drawn from
it, and the machine (it changes control state only where it applies the
table, and only ever reaches states the table knows).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_machine import aggregate_reply, error, event, opened, resumable, token
from test_machine_fuzz import FUZZ, Server, drawn_machine, run_operation

import changestream._machine as machine_module
from changestream._machine import (
    _EFFECTS,
    ChangeStreamMachine,
    Deliver,
    ReplyInfo,
)
from changestream._states import (
    COMMANDS,
    INITIAL,
    Act,
    Cursor,
    Effect,
    Event,
    Op,
    Phase,
    State,
    Transition,
    TransitionError,
    markdown,
    mermaid,
    reachable,
    transition,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "resumability.md"
TOOL = Path(__file__).resolve().parents[2] / "tools" / "gen_state_docs.py"
NEW, OPEN, PENDING, CLOSED = Phase.NEW, Phase.OPEN, Phase.RESUME_PENDING, Phase.CLOSED
LIVE, DONE, NONE = Cursor.LIVE, Cursor.DONE, Cursor.NONE
E = Effect


def S(phase: Phase = NEW, op: Op | None = None, flight: Act | None = None,
      plan: tuple[Act, ...] = (), cursor: Cursor = NONE, getmores: int | None = None) -> State:
    return State(phase, op, flight, plan, cursor, getmores)


IDLE_OPEN = S(OPEN, cursor=LIVE)
NEXT_OPEN = S(OPEN, Op.NEXT, cursor=LIVE)
IN_GETMORE = S(OPEN, Op.NEXT, Act.GETMORE, cursor=LIVE)
FAILED_LIVE = S(CLOSED, Op.NEXT, plan=(Act.KILL_CURSORS, Act.RAISE), cursor=LIVE)
FAIL_EFFECTS = (E.CLEAR_BUFFER, E.KEEP_ERROR)
AGGREGATE_OK = (E.NOTE_SERVER_TIME, E.STORE_CURSOR, E.LOAD_BATCH)

LISTED: list[tuple[str, State, Event, Transition]] = [
    # The caller.
    ("start", INITIAL, Event.START, Transition(S(op=Op.START))),
    ("next", IDLE_OPEN, Event.NEXT, Transition(NEXT_OPEN)),
    ("try_next: one getMore", IDLE_OPEN, Event.TRY_NEXT,
     Transition(S(OPEN, Op.TRY_NEXT, cursor=LIVE, getmores=1))),
    ("next on a closed stream", S(CLOSED), Event.NEXT, Transition(S(CLOSED, Op.NEXT))),
    ("close kills a live cursor", IDLE_OPEN, Event.CLOSE,
     Transition(S(CLOSED, Op.CLOSE, plan=(Act.KILL_CURSORS, Act.NO_DOCUMENT), cursor=LIVE),
             (E.CLEAR_BUFFER,))),
    ("close with an exhausted cursor", S(OPEN, Op.NEXT, cursor=DONE, getmores=None), Event.CLOSE,
     Transition(S(CLOSED, Op.CLOSE, plan=(Act.NO_DOCUMENT,), cursor=DONE), (E.CLEAR_BUFFER,))),
    ("abort forgets the command in flight, then closes", IN_GETMORE, Event.ABORT,
     Transition(S(CLOSED, Op.CLOSE, plan=(Act.KILL_CURSORS, Act.NO_DOCUMENT), cursor=LIVE),
             (E.CLEAR_BUFFER,))),
    ("abandon leaves a command in flight to its shell", IN_GETMORE, Event.ABANDON,
     Transition(IN_GETMORE)),
    ("abandon hands the live cursor's killCursors over", IDLE_OPEN, Event.ABANDON,
     Transition(S(CLOSED), (E.CLEAR_BUFFER,), Act.KILL_CURSORS)),
    ("abandon without a live cursor", S(OPEN, cursor=DONE), Event.ABANDON,
     Transition(S(CLOSED), (E.CLEAR_BUFFER, E.DROP_CURSOR))),
    # next_action().
    ("the plan first: a command goes in flight",
     S(CLOSED, Op.CLOSE, plan=(Act.KILL_CURSORS, Act.NO_DOCUMENT), cursor=LIVE), Event.ACT,
     Transition(S(CLOSED, Op.CLOSE, Act.KILL_CURSORS, (Act.NO_DOCUMENT,)), (), Act.KILL_CURSORS)),
    ("the plan first, whatever is buffered: a result ends the operation",
     S(OPEN, Op.START, plan=(Act.NO_DOCUMENT,), cursor=LIVE), Event.ACT_BUFFERED,
     Transition(IDLE_OPEN, (), Act.NO_DOCUMENT)),
    ("the initial aggregate", S(op=Op.START), Event.ACT,
     Transition(S(op=Op.START, flight=Act.AGGREGATE), (), Act.AGGREGATE)),
    ("a closed stream returns nothing", S(CLOSED, Op.NEXT), Event.ACT,
     Transition(S(CLOSED), (), Act.NO_DOCUMENT)),
    ("resume: kill the live cursor, then aggregate", S(PENDING, Op.NEXT, cursor=LIVE), Event.ACT,
     Transition(S(PENDING, Op.NEXT, Act.KILL_CURSORS, (Act.RESUME,)), (E.BEGIN_RESUME,),
             Act.KILL_CURSORS)),
    ("resume without a cursor: aggregate at once", S(PENDING, Op.NEXT), Event.ACT,
     Transition(S(PENDING, Op.NEXT, Act.RESUME), (E.BEGIN_RESUME, E.DROP_CURSOR), Act.RESUME)),
    ("a buffered document is taken", NEXT_OPEN, Event.ACT_BUFFERED,
     Transition(NEXT_OPEN, (E.TAKE_DOCUMENT,))),
    ("the cursor's end closes the stream", S(OPEN, Op.NEXT, cursor=DONE), Event.ACT,
     Transition(S(CLOSED, cursor=DONE), (E.CLEAR_BUFFER,), Act.NO_DOCUMENT)),
    ("the cursor ended mid split event", S(OPEN, Op.NEXT, cursor=DONE), Event.ACT_MID_SPLIT,
     Transition(S(CLOSED, cursor=DONE), FAIL_EFFECTS, Act.RAISE)),
    ("a split event continues in the next batch", NEXT_OPEN, Event.ACT_MID_SPLIT,
     Transition(IN_GETMORE, (), Act.GETMORE)),
    ("getMore", NEXT_OPEN, Event.ACT, Transition(IN_GETMORE, (), Act.GETMORE)),
    ("try_next spends its getMore", S(OPEN, Op.TRY_NEXT, cursor=LIVE, getmores=1), Event.ACT,
     Transition(S(OPEN, Op.TRY_NEXT, Act.GETMORE, cursor=LIVE, getmores=0), (), Act.GETMORE)),
    ("try_next with no getMore left", S(OPEN, Op.TRY_NEXT, cursor=LIVE, getmores=0), Event.ACT,
     Transition(IDLE_OPEN, (), Act.NO_DOCUMENT)),
    # The document taken.
    ("an event", NEXT_OPEN, Event.DOCUMENT, Transition(IDLE_OPEN, (E.CACHE_TOKEN,), Act.DELIVER)),
    ("the last event of a batch", NEXT_OPEN, Event.LAST_DOCUMENT,
     Transition(IDLE_OPEN, (E.CACHE_LAST_TOKEN,), Act.DELIVER)),
    ("the last event of the final batch", S(OPEN, Op.NEXT, cursor=DONE), Event.LAST_DOCUMENT,
     Transition(S(CLOSED, cursor=DONE), (E.CACHE_LAST_TOKEN, E.CLEAR_BUFFER), Act.DELIVER)),
    ("a fragment: take the next document", NEXT_OPEN, Event.FRAGMENT, Transition(NEXT_OPEN)),
    ("bad data fails the stream and kills its cursor", NEXT_OPEN, Event.FAIL,
     Transition(FAILED_LIVE, FAIL_EFFECTS)),
    # Replies.
    ("watch() opened the stream", S(op=Op.START, flight=Act.AGGREGATE), Event.REPLY,
     Transition(S(OPEN, Op.START, plan=(Act.NO_DOCUMENT,), cursor=LIVE),
             (E.NOTE_SERVER_TIME, E.STORE_CURSOR, E.CHECK_START_TOKEN, E.LOAD_BATCH,
              E.SAVE_OPERATION_TIME))),
    ("a resume that opened an exhausted cursor", S(PENDING, Op.NEXT, Act.RESUME), Event.FINAL_REPLY,
     Transition(S(OPEN, Op.NEXT, cursor=DONE), AGGREGATE_OK)),
    ("a getMore reply", IN_GETMORE, Event.REPLY,
     Transition(NEXT_OPEN, (E.NOTE_SERVER_TIME, E.UPDATE_CURSOR, E.RESET_IDLE, E.LOAD_BATCH))),
    ("a malformed getMore reply", IN_GETMORE, Event.BAD_REPLY,
     Transition(FAILED_LIVE, (E.NOTE_SERVER_TIME, *FAIL_EFFECTS))),
    ("killCursors answered: the plan goes on",
     S(PENDING, Op.NEXT, Act.KILL_CURSORS, (Act.RESUME,)), Event.KILLED,
     Transition(S(PENDING, Op.NEXT, plan=(Act.RESUME,)))),
    # Errors.
    ("the initial aggregate is retried once", S(op=Op.START, flight=Act.AGGREGATE),
     Event.RETRYABLE_ERROR, Transition(S(op=Op.START, plan=(Act.RETRY_AGGREGATE,)))),
    ("so is a resume", S(PENDING, Op.NEXT, Act.RESUME), Event.RETRYABLE_ERROR,
     Transition(S(PENDING, Op.NEXT, plan=(Act.RETRY_RESUME,)))),
    ("the retry's error fails watch()", S(op=Op.START, flight=Act.RETRY_AGGREGATE),
     Event.RETRYABLE_ERROR, Transition(S(CLOSED, Op.START, plan=(Act.RAISE,)), FAIL_EFFECTS)),
    ("a timeout of watch() fails it", S(op=Op.START, flight=Act.AGGREGATE), Event.TIMEOUT,
     Transition(S(CLOSED, Op.START, plan=(Act.RAISE,)), FAIL_EFFECTS)),
    ("a resume's timeout keeps the stream", S(PENDING, Op.NEXT, Act.RETRY_RESUME), Event.TIMEOUT,
     Transition(S(PENDING, Op.NEXT, plan=(Act.RAISE,)), (E.KEEP_ERROR,))),
    ("a resume's error closes it", S(PENDING, Op.NEXT, Act.RESUME), Event.ERROR,
     Transition(S(CLOSED, Op.NEXT, plan=(Act.RAISE,)), FAIL_EFFECTS)),
    ("a getMore's timeout: raise, resume on the next call", IN_GETMORE, Event.TIMEOUT,
     Transition(S(PENDING, Op.NEXT, plan=(Act.RAISE,), cursor=LIVE), (E.KEEP_ERROR,))),
    ("fruitless resumes: raise, resume on the next call", IN_GETMORE,
     Event.FRUITLESS_RESUMABLE_ERROR,
     Transition(S(PENDING, Op.NEXT, plan=(Act.RAISE,), cursor=LIVE), (E.KEEP_ERROR,))),
    ("a resumable error resumes at once", IN_GETMORE, Event.RESUMABLE_ERROR,
     Transition(S(PENDING, Op.NEXT, plan=(Act.KILL_CURSORS, Act.RESUME), cursor=LIVE),
             (E.BEGIN_RESUME,))),
    ("try_next after a resume: only the new first batch",
     S(OPEN, Op.TRY_NEXT, Act.GETMORE, cursor=LIVE, getmores=0), Event.RESUMABLE_ERROR,
     Transition(S(PENDING, Op.TRY_NEXT, plan=(Act.KILL_CURSORS, Act.RESUME), cursor=LIVE,
               getmores=0), (E.BEGIN_RESUME,))),
    ("a load-balanced cursor died with its connection: no killCursors", IN_GETMORE,
     Event.CURSOR_LOST,
     Transition(S(PENDING, Op.NEXT, plan=(Act.RESUME,)), (E.BEGIN_RESUME, E.DROP_CURSOR))),
    ("a getMore's other error fails the stream", IN_GETMORE, Event.ERROR,
     Transition(FAILED_LIVE, FAIL_EFFECTS)),
    ("a getMore interrupted by a close from aside closes, never resumes", IN_GETMORE,
     Event.CLOSING_ERROR,
     Transition(S(CLOSED, Op.NEXT, plan=(Act.KILL_CURSORS, Act.NO_DOCUMENT), cursor=LIVE),
             (E.CLEAR_BUFFER,))),
]


@pytest.mark.parametrize(("state", "event", "expected"), [row[1:] for row in LISTED],
                         ids=[row[0] for row in LISTED])
def test_listed_transition(state: State, event: Event, expected: Transition) -> None:
    assert transition(state, event) == expected
    assert transition(state, event) == expected, "the memoised row gives the same"


IMPOSSIBLE: list[tuple[State, Event, str]] = [
    (INITIAL, Event.NEXT, "start() must succeed before iterating"),
    (S(op=Op.START), Event.START, "start() runs once"),
    (S(CLOSED), Event.START, "start() runs once"),
    (NEXT_OPEN, Event.TRY_NEXT, "an operation (next) is already in progress"),
    (IN_GETMORE, Event.CLOSE, "feed the outcome of the in-flight command before close"),
    (IN_GETMORE, Event.ACT, "feed the outcome of the in-flight command first"),
    (IDLE_OPEN, Event.ACT, "no operation in progress"),
    (S(CLOSED, Op.CLOSE), Event.ACT, "close has nothing left to do"),
    (S(OPEN, Op.NEXT), Event.ACT, "an open stream needs its cursor"),
    (NEXT_OPEN, Event.REPLY, "no aggregate or getMore is in flight"),
    (S(CLOSED, Op.CLOSE, Act.KILL_CURSORS, (Act.NO_DOCUMENT,)), Event.BAD_REPLY,
     "no aggregate or getMore is in flight"),
    (IN_GETMORE, Event.KILLED, "no killCursors is in flight"),
    (S(OPEN, Op.START, Act.RESUME), Event.REPLY, "cannot be in flight in phase 'open'"),
    (S(op=Op.START, flight=Act.AGGREGATE), Event.RESUMABLE_ERROR,
     "aggregate errors are classified by the retryable-reads spec"),
    (IN_GETMORE, Event.RETRYABLE_ERROR, "getMore errors are classified by resumability"),
    (S(PENDING, Op.NEXT, Act.RESUME), Event.CLOSING_ERROR,
     "only a getMore is interrupted by a close from aside"),
    (S(op=Op.START), Event.DOCUMENT, "only a next/try_next on an open stream"),
    (S(op=Op.START, plan=(Act.NO_DOCUMENT,)), Event.FAIL, "bad data is found only"),
]


@pytest.mark.parametrize(("state", "event", "why"), IMPOSSIBLE,
                         ids=[f"{row[1].name}-{i}" for i, row in enumerate(IMPOSSIBLE)])
def test_an_impossible_pair_raises_at_once_and_every_time(state: State, event: Event,
                                                          why: str) -> None:
    for _ in range(2):  # a refusal is never memoised as an outcome
        with pytest.raises(TransitionError, match=re.escape(why)) as caught:
            transition(state, event)
        assert f"{event.value!r} cannot happen" in str(caught.value)
        assert str(state) in str(caught.value), "the message shows the whole state"
    assert issubclass(TransitionError, RuntimeError)


# -- the whole table, explored --------------------------------------------------------------------
ROWS = list(reachable())
STATES = {state for state, _, _ in ROWS} | {outcome.state for _, _, outcome in ROWS}


def test_every_rule_is_listed_above() -> None:
    """LISTED covers every event, from states the table really reaches; all of it is used."""
    assert {event for _, _, event, _ in LISTED} == set(Event), "every event is listed"
    assert {row[1] for row in ROWS} == set(Event), "every event happens somewhere"
    assert {o.act for _, _, o in ROWS} - {None} == set(Act), "every act is used"
    assert {e for _, _, o in ROWS for e in o.effects} == set(Effect), "every effect is used"
    assert {s.phase for s in STATES} == set(Phase), "every phase is reachable"
    unreal = [name for name, state, _, _ in LISTED if state not in STATES]
    assert not unreal, f"listed from states the machine never reaches: {unreal}"


def test_closed_is_final() -> None:
    assert {o.state.phase for s, _, o in ROWS if s.phase is CLOSED} == {CLOSED}


@pytest.mark.parametrize("row", range(len(ROWS)))
def test_every_reachable_transition_keeps_the_invariants(row: int) -> None:
    state, event, outcome = ROWS[row]
    new = outcome.state
    for s in (state, new):
        assert s.flight is None or (s.flight in COMMANDS and s.op is not None), s
        assert s.op is not None or (not s.plan and s.flight is None), "idle: nothing planned"
        assert s.getmores is None or s.op is Op.TRY_NEXT, "a getMore budget is try_next's"
        assert s.phase is not NEW or s.cursor is NONE
        assert s.phase is not OPEN or s.cursor is not NONE, "an open stream has its cursor"
        assert len(s.plan) <= 2 and all(a in COMMANDS for a in s.plan[:-1])
        assert Act.KILL_CURSORS not in s.plan[1:], "killCursors comes first"
        assert Act.KILL_CURSORS not in s.plan or s.cursor is LIVE, "only a live cursor is killed"
        assert Act.DELIVER not in s.plan, "documents are delivered as they are taken"
    if outcome.act in (Act.DELIVER, Act.NO_DOCUMENT, Act.RAISE):
        assert new.op is None and new.flight is None, "a result ends the operation"
    elif outcome.act is not None and event is not Event.ABANDON:
        assert new.flight is outcome.act, "a command returned is the command in flight"
    if outcome.act is Act.KILL_CURSORS:
        assert state.cursor is LIVE and new.cursor is NONE
    if outcome.act is Act.GETMORE:
        assert new.cursor is LIVE
    if outcome.act is Act.RAISE:
        assert Effect.KEEP_ERROR in outcome.effects or state.plan == (Act.RAISE,) or (
            state.plan == (Act.KILL_CURSORS, Act.RAISE)), "an error is kept before it is raised"
    follow_ups = [e for e in outcome.effects if e in (E.TAKE_DOCUMENT, E.SAVE_OPERATION_TIME)]
    if follow_ups:
        assert outcome.effects[-1] is follow_ups[0] and outcome.act is None, (
            "an effect that may report the next event comes last, with nothing to return")
    if event in (Event.ACT, Event.ACT_BUFFERED, Event.ACT_MID_SPLIT):
        assert outcome.act is not None or outcome.effects == (E.TAKE_DOCUMENT,), (
            "next_action always makes progress: no hot loop")


def test_the_fast_path_is_a_transition_that_changes_no_control_state() -> None:
    """``next_buffered`` skips the table; there NEXT/TRY_NEXT, ACT_BUFFERED, DOCUMENT are a no-op."""
    idle_open = [s for s in STATES if s.phase is OPEN and s.op is None]
    assert idle_open
    for state in idle_open:
        for begin in (Event.NEXT, Event.TRY_NEXT):
            started = transition(state, begin).state
            taking = transition(started, Event.ACT_BUFFERED)
            assert taking == Transition(started, (E.TAKE_DOCUMENT,))
            assert transition(started, Event.DOCUMENT) == Transition(state, (E.CACHE_TOKEN,),
                                                                  Act.DELIVER)


def test_states_are_frozen_and_shared() -> None:
    with pytest.raises(AttributeError):
        INITIAL.phase = OPEN  # type: ignore[misc]
    first = transition(INITIAL, Event.START).state
    assert transition(S(), Event.START).state is first, "one object per state value"


# -- the docs -----------------------------------------------------------------------------------
def _generated(name: str, text: str) -> str:
    found = re.search(rf"<!-- {name}:begin[^>]*-->\n(.*?)\n<!-- {name}:end -->", text, re.S)
    assert found is not None, f"docs/resumability.md lost its generated {name}"
    return found.group(1)


def test_the_docs_diagram_and_transition_table_are_the_table() -> None:
    text = DOC.read_text()
    hint = "regenerate: python tools/gen_state_docs.py"
    assert _generated("states", text) == f"```mermaid\n{mermaid()}\n```", hint
    assert _generated("transitions", text) == markdown(), hint


def test_the_docs_generator_writes_what_the_test_expects() -> None:
    spec = importlib.util.spec_from_file_location("gen_state_docs", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    stale = DOC.read_text().replace("aggregate ok", "aggregate OK")
    assert tool.render(stale) == tool.render(DOC.read_text()) == DOC.read_text()


def test_the_diagram_shows_what_users_meet() -> None:
    diagram = mermaid()
    assert "Open --> ResumePending: resumable error / client timeout" in diagram
    assert "ResumePending --> Open: aggregate ok" in diagram
    assert "ResumePending --> ResumePending: retryable error, retried once / client timeout" in (
        diagram), "a timeout while resuming keeps the stream"
    assert not re.search(r"Closed --> (New|Open|ResumePending)", diagram)


# -- the machine applies the table and nothing else ---------------------------------------------
CONTROL = {"_state"}
OLD_FIELDS = {"_phase", "_op", "_inflight", "_ready", "_after_kill", "_getmores_left"}
DATA = {"_token", "_token_event", "_use_start_after", "_operation_time", "_cursor", "_batch", "_post_batch_token",
        "_error", "_server_time", "_resumes", "_idle_resumes"}
MUTATORS = {"popleft", "clear", "append", "extend", "reset", "add"}


def _methods() -> Iterator[ast.FunctionDef]:
    tree = ast.parse(inspect.getsource(machine_module))
    cls = next(node for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name == "ChangeStreamMachine")
    yield from (node for node in cls.body if isinstance(node, ast.FunctionDef))


def _self_attribute(node: ast.AST) -> str | None:
    """``x`` for ``self.x`` or ``self.x.y`` (what an assignment or call changes)."""
    while isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr
        node = node.value
    return None


def _writes(method: ast.FunctionDef) -> set[str]:
    written: set[str] = set()
    for node in ast.walk(method):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):
            targets = [node.func.value]
        for target in targets:
            for leaf in ast.walk(target):
                name = _self_attribute(leaf)
                if name is not None:
                    written.add(name)
    return written


def test_control_state_is_assigned_only_where_the_table_is_applied() -> None:
    writers = {m.name: _writes(m) for m in _methods()}
    assert {name for name, w in writers.items() if w & CONTROL} == {"__init__", "_fire"}
    source = inspect.getsource(machine_module)
    assert not OLD_FIELDS & {n.attr for n in ast.walk(ast.parse(source))
                             if isinstance(n, ast.Attribute)}, "the old scattered fields are gone"
    calls = [m.name for m in _methods() for n in ast.walk(m)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "transition"]
    assert calls == ["_fire"], "the table is looked up in one place"


def test_data_changes_only_in_the_tables_effects() -> None:
    """Outside __init__, data is written by effects, by building the act, and by the fast path.

    (And by ``resume_token``, which slices a raw event's token out when first
    asked for: the same token, materialised.)
    """
    effects = {function.__name__ for function in _EFFECTS.values()}
    assert set(_EFFECTS) == set(Effect), "every effect has its implementation"
    allowed = effects | {"__init__", "_build", "_kill", "next_buffered", "resume_token"}
    for method in _methods():
        written = _writes(method) & DATA
        assert not written or method.name in allowed, (
            f"{method.name} changes {sorted(written)} outside the table's effects")


# -- the machine, driven: only states the table knows, cursor data agreeing with the state -------
def _check(machine: ChangeStreamMachine) -> None:
    state = machine.state
    assert state in STATES, f"a state the table does not reach: {state}"
    cursor = machine._cursor
    expected = NONE if cursor is None else (LIVE if cursor.id else DONE)
    assert state.cursor is expected, (state, cursor)
    assert machine.alive is (state.phase is not CLOSED)
    assert machine.busy is (state.op is not None)


@FUZZ
@given(st.data())
def test_a_driven_machine_stays_inside_the_table(data: Any) -> None:
    machine = drawn_machine(data)
    server = Server(data.draw)
    begin = machine.start
    for _ in range(data.draw(st.integers(1, 6))):
        run_operation(machine, server, begin, lambda: _check(machine))
        if not machine.alive:
            break
        begin = data.draw(st.sampled_from(
            [machine.begin_next, machine.begin_try_next, machine.close]))
    machine.abandon()
    _check(machine)
    assert not machine.alive


def test_a_resume_walks_the_table_step_by_step() -> None:
    """A resumable getMore error: the states the machine passes, and the commands they stand for."""
    machine = opened(pbrt=token(1)).machine
    info = ReplyInfo(("a", 1), 17)
    steps: list[tuple[State, str]] = []

    def act() -> Any:
        action = machine.next_action()
        steps.append((machine.state, type(action).__name__))
        return action

    machine.begin_next()
    act()
    machine.receive_error(resumable())
    assert machine.state == S(PENDING, Op.NEXT, plan=(Act.KILL_CURSORS, Act.RESUME), cursor=LIVE)
    assert machine.resumes == 1 and machine.cursor_id == 42, "the cursor is killed when sent"
    act()
    assert machine.cursor_id is None
    machine.receive_error(error(43))  # spec: a killCursors error is ignored
    resume = act()
    assert resume.command["pipeline"][0]["$changeStream"] == {"resumeAfter": token(1)}
    machine.receive_reply(aggregate_reply([event(2)]), info)
    delivered = act()
    assert isinstance(delivered, Deliver) and delivered.document == event(2)
    assert steps == [
        (IN_GETMORE, "RunGetMore"),
        (S(PENDING, Op.NEXT, Act.KILL_CURSORS, (Act.RESUME,)), "KillCursors"),
        (S(PENDING, Op.NEXT, Act.RESUME), "RunAggregate"),
        (S(OPEN, cursor=LIVE), "Deliver"),
    ]
