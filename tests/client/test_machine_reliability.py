"""The machine refuses half-valid tokens and malformed batches, and never resumes in a hot loop."""

from __future__ import annotations

import logging
from typing import Any

import bson
import pytest
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp
from test_machine import (
    Driver,
    aggregate_reply,
    delivered,
    error,
    event,
    getmore_reply,
    opened,
    raised,
    resumable,
    token,
)

from changestream._machine import MAX_IDLE_RESUMES, NoDocument, Phase
from changestream.errors import (
    ChangeStreamError,
    InvalidResumeTokenError,
    MalformedReplyError,
)

BAD_TOKENS = ["82AB", 5, {}, {"_data": 5}, {"_data": None}, [token(1)], None]


@pytest.mark.parametrize("bad", BAD_TOKENS[:-1], ids=repr)
def test_an_event_id_that_is_not_a_token_is_refused_and_never_cached(bad: Any) -> None:
    driver = opened(pbrt=token(1))
    batch = [event(2), {**event(3), "_id": bad}]
    assert delivered(driver.next(getmore_reply(batch, pbrt=token(9)))) == event(2)
    err = raised(driver.next(getmore_reply()))  # the bad event is already buffered
    assert isinstance(err, InvalidResumeTokenError)
    assert err.field == "_id"
    assert err.value == bad
    assert repr(bad)[:20] in str(err)
    assert driver.machine.resume_token == token(2), "the last valid token stays"
    assert not driver.machine.alive


@pytest.mark.parametrize("bad", BAD_TOKENS[:-1], ids=repr)
@pytest.mark.parametrize("where", ["aggregate", "getMore"])
def test_a_post_batch_token_that_is_not_a_token_is_refused(bad: Any, where: str) -> None:
    if where == "aggregate":
        driver = Driver()
        err = raised(driver.start(aggregate_reply(pbrt=bad)))
        assert driver.machine.resume_token is None
    else:
        driver = opened(pbrt=token(1))
        err = raised(driver.try_next(getmore_reply(pbrt=bad), {"ok": 1}))
        assert driver.machine.resume_token == token(1)
    assert isinstance(err, InvalidResumeTokenError)
    assert err.field == "cursor.postBatchResumeToken"
    assert err.value == bad
    assert "postBatchResumeToken" in str(err)


def test_a_raw_event_whose_id_is_a_string_is_refused() -> None:
    raw = RawBSONDocument(bson.encode({"_id": "82AB", "operationType": "insert"}))
    driver = opened(raw, RawBSONDocument(bson.encode(event(2))))
    err = raised(driver.next({"ok": 1}))
    assert isinstance(err, InvalidResumeTokenError)
    assert err.value == "82AB"


def test_a_raw_event_with_a_valid_token_still_takes_the_fast_slice() -> None:
    raw = [RawBSONDocument(bson.encode(event(n))) for n in (1, 2, 3)]
    driver = opened(*raw)
    assert dict(driver.machine.next_buffered()["_id"]) == token(1)
    assert dict(driver.machine.resume_token) == token(1)


@pytest.mark.parametrize(
    ("batch", "shown"), [("abc", "str 'abc'"), ({"a": 1}, "dict {'a': 1}"), (None, "NoneType")]
)
def test_a_next_batch_that_is_not_an_array_is_a_clear_error(batch: Any, shown: str) -> None:
    driver = opened(pbrt=token(1))
    err = raised(driver.next({"ok": 1, "cursor": {"id": 42, "nextBatch": batch}}, {"ok": 1}))
    assert isinstance(err, MalformedReplyError)
    assert err.field == "cursor.nextBatch"
    assert shown in str(err)
    assert driver.machine.resume_token == token(1)


@pytest.mark.parametrize(
    ("reply", "field"),
    [
        ("not a reply", "reply"),
        ({"ok": 1, "cursor": 7}, "cursor"),
        ({"ok": 1, "cursor": {"id": "42", "firstBatch": []}}, "cursor.id"),
        ({"ok": 1, "cursor": {"id": 42, "firstBatch": [], "ns": 5}}, "cursor.ns"),
        ({"ok": 1, "cursor": {"id": 0, "firstBatch": []}, "operationTime": "x"},
         "operationTime"),
    ],
)
def test_malformed_aggregate_replies_name_the_field(reply: Any, field: str) -> None:
    err = raised(Driver().start(reply))
    assert isinstance(err, MalformedReplyError)
    assert err.field == field


def test_an_event_that_is_not_a_document_is_a_clear_error() -> None:
    driver = opened(pbrt=token(1))
    err = raised(driver.next(getmore_reply(["not an event"]), {"ok": 1}))  # type: ignore[list-item]
    assert isinstance(err, ChangeStreamError)
    assert "must be a document" in str(err)


def dated_token(seconds: int) -> dict[str, Any]:
    """A resume token (hex KeyString) at cluster time ``seconds``."""
    return {"_data": f"82{seconds:08X}00000001" + "2B022C0100296E5A1004" + "AB" * 16 + "04"}


@pytest.mark.parametrize("option", ["resume_after", "start_after"])
def test_a_refused_future_start_token_kills_the_cursor_it_opened(option: str) -> None:
    """The server opened cursor 42 for a token a year ahead of its clock: the stream is
    refused, and that cursor is killed (it stayed open on the server before)."""
    now = 1_700_000_000
    future = dated_token(now + 366 * 86_400)
    driver = Driver(**{option: future})
    reply = {**aggregate_reply(pbrt=future), "operationTime": Timestamp(now, 1)}
    err = raised(driver.start(reply, {"ok": 1}))
    assert isinstance(err, InvalidResumeTokenError)
    assert err.field == ("resumeAfter" if option == "resume_after" else "startAfter")
    assert driver.names() == ["aggregate", "killCursors"]
    kill = driver.commands[1].command
    assert kill["killCursors"] == "coll" and kill["cursors"] == [42]
    assert driver.machine.resume_token == future, "the caller's token stays cached"
    assert not driver.machine.alive


def test_a_resume_is_not_checked_against_the_start_token() -> None:
    """A resume's token is one the server gave: a reply whose clock lags it is not refused."""
    now = 1_700_000_000
    driver = opened(event(1), event(2), pbrt=dated_token(now + 366 * 86_400))
    assert delivered(driver.next()) == event(1)
    assert delivered(driver.next()) == event(2)
    lagging = {**aggregate_reply(pbrt=token(3)), "operationTime": Timestamp(now, 1)}
    result = driver.try_next(resumable(), {"ok": 1}, lagging)
    assert isinstance(result, NoDocument)
    assert driver.machine.alive


class TestNoHotLoop:
    """A server that accepts every resume aggregate and fails every getMore."""

    def test_next_gives_up_after_the_bound_and_raises_the_repeated_error(self) -> None:
        driver = opened(pbrt=token(1))
        outcomes: list[Any] = [resumable()]
        for _ in range(MAX_IDLE_RESUMES):
            outcomes += [{"ok": 1}, aggregate_reply(pbrt=token(1)), resumable()]
        err = raised(driver.next(*outcomes))
        assert "scripted error code=6" in str(err)
        assert driver.names().count("aggregate") == 1 + MAX_IDLE_RESUMES
        assert driver.machine.phase is Phase.RESUME_PENDING, "the stream stays resumable"
        assert driver.machine.alive
        # the next call resumes once (one resume per error), then raises again
        err = raised(driver.next({"ok": 1}, aggregate_reply(pbrt=token(1)), resumable()))
        assert driver.names().count("aggregate") == 2 + MAX_IDLE_RESUMES

    def test_try_next_resumes_once_per_call_until_the_bound(self) -> None:
        driver = opened(pbrt=token(1))
        for _ in range(MAX_IDLE_RESUMES):
            result = driver.try_next(resumable(), {"ok": 1}, aggregate_reply(pbrt=token(1)))
            assert isinstance(result, NoDocument)
            # the resumed cursor is live: the next try_next starts with a getMore
        assert driver.machine.idle_resumes == MAX_IDLE_RESUMES
        raised(driver.try_next(resumable()))

    def test_a_successful_get_more_resets_the_count(self) -> None:
        driver = opened(pbrt=token(1))
        outcomes: list[Any] = []
        for _ in range(MAX_IDLE_RESUMES):
            outcomes += [resumable(), {"ok": 1}, aggregate_reply(pbrt=token(1))]
        outcomes += [getmore_reply(pbrt=token(2))]
        outcomes += [resumable(), {"ok": 1}, aggregate_reply(pbrt=token(2))]
        outcomes += [getmore_reply([event(3)])]
        assert delivered(driver.next(*outcomes)) == event(3)
        assert driver.machine.idle_resumes == 0

    def test_a_non_resumable_error_is_unaffected(self) -> None:
        driver = opened(pbrt=token(1))
        raised(driver.next(error(2), {"ok": 1}))
        assert not driver.machine.alive


@pytest.mark.parametrize("code", [43, 237], ids=["CursorNotFound", "CursorKilled"])
def test_a_get_more_killed_by_a_close_from_aside_closes_without_resuming(
    code: int, caplog: pytest.LogCaptureFixture
) -> None:
    """close() from another thread kills the waiting getMore's cursor aside: its error
    (CursorNotFound looks resumable) must close the stream, not log and count a resume."""
    driver = opened(pbrt=token(1))
    machine = driver.machine
    machine.begin_next()
    getmore = machine.next_action()
    assert "getMore" in getmore.command  # type: ignore[union-attr]
    kill = machine.in_flight_kill()
    assert kill is not None
    machine.request_close()  # what the shell's close() does before sending the kill aside
    with caplog.at_level(logging.INFO, logger="changestream"):
        machine.receive_error(error(code, labels=["ResumableChangeStreamError"]))
        assert machine.phase is Phase.CLOSED and machine.resumes == 0
        kill_again = machine.next_action()  # the cursor, should the kill aside have missed it
        assert "killCursors" in kill_again.command  # type: ignore[union-attr]
        machine.receive_error(error(43))
        assert isinstance(machine.next_action(), NoDocument)
    assert not [r for r in caplog.records if "resuming" in r.getMessage()]
    assert machine.resume_token == token(1) and not machine.alive
