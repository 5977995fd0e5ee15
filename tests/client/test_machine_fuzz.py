"""Property-based fuzzing of the state machine: arbitrary mutations of valid replies and errors.

Whatever the server sends, an operation ends in a correct delivery (an event
of a batch, in order, with a valid token) or in one error: the scripted
server error itself, or one of the ``ChangeStreamError`` family that names the
field and value. Never a ``TypeError``/``KeyError``, and the cached resume
token is always a document with a ``_data`` string.

The default suite runs a small, derandomized budget (``FUZZ_EXAMPLES``);
``CHANGESTREAM_FUZZ_EXAMPLES=20000 python -m pytest tests/client/test_machine_fuzz.py``
runs a longer campaign.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import bson
from bson.int64 import Int64
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pymongo.errors import OperationFailure
from test_machine import make_spec

from changestream._machine import (
    ChangeStreamMachine,
    Deliver,
    ErrorInfo,
    KillCursors,
    NoDocument,
    Raise,
    ReplyInfo,
    RunAggregate,
)
from changestream.errors import ChangeStreamError, MalformedReplyError

FUZZ_EXAMPLES = int(os.environ.get("CHANGESTREAM_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- what a server might send ---------------------------------------------------------------------
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True),
    st.text(max_size=12), st.binary(max_size=8), st.just(Timestamp(1, 1)), st.just(Int64(5)),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.sampled_from(["_id", "_data", "x", "ns", "id"]), children, max_size=3),
    ),
    max_leaves=8,
)


def token(n: int) -> dict[str, Any]:
    return {"_data": f"82{n:016X}"}


def event(n: int) -> dict[str, Any]:
    return {"_id": token(n), "operationType": "insert", "documentKey": {"_id": n}}


CURSOR_FIELDS = ["id", "ns", "firstBatch", "nextBatch", "postBatchResumeToken"]


@st.composite
def mutated(draw: st.DrawFn, reply: dict[str, Any]) -> dict[str, Any] | Any:
    """``reply``, possibly with one field replaced or removed (at the top, in the cursor, in an event)."""
    kind = draw(st.sampled_from(["keep", "keep", "top", "cursor", "event", "drop", "whole"]))
    if kind == "keep":
        return reply
    if kind == "whole":
        return draw(values)
    cursor = dict(reply["cursor"])
    reply = {**reply, "cursor": cursor}
    if kind == "top":
        reply[draw(st.sampled_from(["cursor", "ok", "operationTime"]))] = draw(values)
    elif kind == "cursor":
        cursor[draw(st.sampled_from(CURSOR_FIELDS))] = draw(values)
    elif kind == "drop":
        cursor.pop(draw(st.sampled_from(CURSOR_FIELDS)), None)
    else:
        field = "firstBatch" if "firstBatch" in cursor else "nextBatch"
        batch = list(cursor[field])
        if batch:
            index = draw(st.integers(0, len(batch) - 1))
            if draw(st.booleans()):
                batch[index] = draw(values)
            else:
                batch[index] = {**batch[index], "_id": draw(values)}
        cursor[field] = batch
    return reply


@st.composite
def server_errors(draw: st.DrawFn) -> ErrorInfo:
    code = draw(st.one_of(st.none(), st.sampled_from([6, 43, 91, 189, 262, 286, 2, 13, 11601]),
                          st.integers(-5, 20000)))
    labels = draw(st.frozensets(st.sampled_from(
        ["ResumableChangeStreamError", "RetryableError", "NonResumableChangeStreamError", "x"]
    )))
    return ErrorInfo(
        exception=OperationFailure(f"scripted {code}", code),
        code=code,
        labels=labels,
        wire_version=draw(st.one_of(st.none(), st.integers(0, 30))),
        is_network=draw(st.booleans()),
        is_timeout=draw(st.booleans()),
        is_server_selection=draw(st.booleans()),
    )


class Server:
    """Answers each command with the next scripted outcome (killCursors always succeeds)."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.next_event = 1
        self.sent: list[Any] = []
        """Every event handed to the machine, in order (valid or not)."""

    def batch(self) -> list[dict[str, Any]]:
        size = self.draw(st.integers(0, 3))
        events = [event(self.next_event + i) for i in range(size)]
        self.next_event += size
        return events

    def answer(self, command: Any) -> Mapping[str, Any] | ErrorInfo | Any:
        if isinstance(command, KillCursors):
            return {"ok": 1}
        if self.draw(st.integers(0, 4)) == 0:
            return self.draw(server_errors())
        field = "firstBatch" if isinstance(command, RunAggregate) else "nextBatch"
        cursor: dict[str, Any] = {
            "id": Int64(self.draw(st.sampled_from([42, 42, 42, 0]))),
            "ns": "db.coll",
            field: self.batch(),
        }
        if self.draw(st.booleans()):
            cursor["postBatchResumeToken"] = token(self.next_event)
        reply = self.draw(mutated({"cursor": cursor, "ok": 1, "operationTime": Timestamp(9, 1)}))
        if isinstance(reply, Mapping) and self.draw(st.booleans()):
            # As the transport hands it over: raw BSON, decoded lazily (a reply that
            # cannot be encoded, e.g. an int beyond 64 bits, stays a dict).
            with contextlib.suppress(Exception):
                reply = RawBSONDocument(bson.encode(reply))
        if isinstance(reply, Mapping) and isinstance(reply.get("cursor"), Mapping):
            for key in ("firstBatch", "nextBatch"):
                batch = reply["cursor"].get(key)
                if isinstance(batch, list):
                    self.sent.extend(_key(d) for d in batch)
        return reply


def _key(document: Any) -> Any:
    """What identifies a sent event: its BSON (raw events are new objects on each access)."""
    try:
        return bson.encode(document) if isinstance(document, Mapping) else repr(document)
    except Exception:
        return repr(document)


def valid_token(value: Any) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("_data"), str)


def check_error(error: BaseException) -> None:
    assert not isinstance(error, (TypeError, KeyError, AttributeError, ValueError)) or isinstance(
        error, ChangeStreamError
    ), f"bare {type(error).__name__}: {error}"
    assert isinstance(error, (OperationFailure, ChangeStreamError)), repr(error)
    if isinstance(error, MalformedReplyError):
        assert error.field and error.field.split(".")[-1].split("[")[0] in str(error), str(error)


def run_operation(machine: ChangeStreamMachine, server: Server, begin: Any,
                  check: Callable[[], None] = lambda: None) -> Any:
    """Run one operation against ``server``; ``check()`` runs after every step of the machine."""
    begin()
    for _ in range(200):  # far more commands than one operation may need
        check()
        action = machine.next_action()
        check()
        if isinstance(action, (Deliver, NoDocument, Raise)):
            return action
        outcome = server.answer(action)
        if isinstance(outcome, ErrorInfo):
            machine.receive_error(outcome)
        else:
            machine.receive_reply(outcome, ReplyInfo(("a", 1), 21))
        assert machine.resume_token is None or valid_token(machine.resume_token)
    raise AssertionError("one operation ran 200 commands: a hot loop")


def drawn_machine(data: Any) -> ChangeStreamMachine:
    """A machine with drawn options (batch size, split-event reassembly)."""
    return ChangeStreamMachine(make_spec(
        batch_size=data.draw(st.sampled_from([None, 2])),
        reassemble_split_events=data.draw(st.booleans()),
    ))


@FUZZ
@given(st.data())
def test_mutated_replies_and_errors_end_in_a_delivery_or_one_clear_error(data: Any) -> None:
    machine = drawn_machine(data)
    server = Server(data.draw)
    delivered: list[Any] = []
    result = run_operation(machine, server, machine.start)
    for _ in range(data.draw(st.integers(1, 8))):
        if isinstance(result, Raise):
            check_error(result.error)
            if not machine.alive:
                break
        if not machine.alive:
            break
        begin = data.draw(st.sampled_from([machine.begin_next, machine.begin_try_next]))
        result = run_operation(machine, server, begin)
        if isinstance(result, Deliver):
            document = result.document
            assert isinstance(document, Mapping) and valid_token(document["_id"])
            assert _key(document) in server.sent, "only what the server sent"
            delivered.append(_key(document))
    if isinstance(result, Raise):
        check_error(result.error)
    # Delivered in the order sent (a resume may re-deliver from the last token, never skip back).
    order = [server.sent.index(d) for d in delivered]
    assert order == sorted(order)
    assert machine.resume_token is None or valid_token(machine.resume_token)
    if machine.alive and not machine.busy:
        machine.close()
        assert isinstance(run_operation(machine, server, lambda: None), NoDocument)
