"""The change-streams prose tests (spec tests/README.md) scripted against the state machine.

Each test is named after its prose number. Replies and errors are canned, so
every command the machine asks for is asserted exactly.
"""

from __future__ import annotations

from typing import Any

from bson.int64 import Int64
from test_machine import (
    SERVER_A,
    SERVER_B,
    Driver,
    Reply,
    aggregate_reply,
    delivered,
    error,
    event,
    getmore_reply,
    raised,
    resumable,
    token,
)

from changestream._machine import KillCursors, NoDocument, RunAggregate, RunGetMore
from changestream.errors import MissingResumeTokenError

KILLED = {"ok": 1, "cursorsKilled": [Int64(42)]}


def test_prose_1_tracks_the_last_seen_resume_token() -> None:
    driver = Driver()
    driver.start(aggregate_reply(pbrt=token(1)))
    seen = [driver.machine.resume_token]
    driver.try_next(getmore_reply([event(2), event(3)], pbrt=token(4)))
    seen.append(driver.machine.resume_token)
    delivered(driver.try_next())
    seen.append(driver.machine.resume_token)
    driver.try_next(getmore_reply(pbrt=token(5)))
    seen.append(driver.machine.resume_token)
    assert seen == [token(1), token(2), token(4), token(5)]


def test_prose_2_missing_resume_token_server_error_is_raised() -> None:
    # Server >= 4.1.8 rejects an event whose _id was projected out (280).
    driver = Driver(pipeline=[{"$project": {"_id": 0}}])
    driver.start(aggregate_reply())
    failure = error(280, labels=["NonResumableChangeStreamError"])
    assert raised(driver.next(failure, KILLED)) is failure.exception
    assert driver.names() == ["aggregate", "getMore", "killCursors"]
    assert not driver.machine.alive


def test_prose_2_missing_resume_token_in_document_is_raised() -> None:
    driver = Driver(pipeline=[{"$project": {"_id": 0}}])
    driver.start(aggregate_reply())
    err = raised(driver.next(getmore_reply([{"operationType": "insert"}]), KILLED))
    assert isinstance(err, MissingResumeTokenError)
    assert not driver.machine.alive


def test_prose_3_resumes_once_with_the_original_pipeline_and_options() -> None:
    options: dict[str, Any] = {
        "pipeline": [{"$match": {"x": 1}}],
        "full_document": "updateLookup",
        "batch_size": 2,
        "collation": {"locale": "en"},
        "comment": "prose3",
    }
    driver = Driver(**options)
    driver.start(aggregate_reply())
    delivered(driver.next(getmore_reply([event(1)], pbrt=token(1))))
    assert isinstance(driver.try_next(resumable(), KILLED, aggregate_reply()), NoDocument)
    first, resumed = (c for c in driver.commands if isinstance(c, RunAggregate))
    expected = {**first.command, "pipeline": [
        {"$changeStream": {"fullDocument": "updateLookup", "resumeAfter": token(1)}},
        {"$match": {"x": 1}},
    ]}
    assert resumed.command == expected
    assert resumed.is_resume


def test_prose_4_no_resume_after_an_aggregate_error() -> None:
    driver = Driver()
    failure = error(2)
    assert raised(driver.start(failure)) is failure.exception
    assert driver.names() == ["aggregate"]
    assert not driver.machine.alive


def test_prose_4_a_retryable_read_retry_is_not_a_resume() -> None:
    driver = Driver()
    failure = error(network=True)
    final = error(network=True)
    assert raised(driver.start(failure, final)) is final.exception
    attempts = [(c.attempt, c.is_resume) for c in driver.commands if isinstance(c, RunAggregate)]
    assert attempts == [(1, False), (2, False)]
    assert "getMore" not in driver.names()


def test_prose_6_server_selection_with_the_original_read_preference_before_resume() -> None:
    driver = Driver(read_preference="secondaryPreferred")
    driver.start(Reply(aggregate_reply(cursor_id=1), address=SERVER_A))
    driver.try_next(resumable(), KILLED, Reply(aggregate_reply(cursor_id=2), address=SERVER_B))
    driver.try_next(getmore_reply(cursor_id=2))
    getmore1, kill, resume, getmore2 = driver.commands[1:]
    assert isinstance(getmore1, RunGetMore) and getmore1.address == SERVER_A
    assert isinstance(kill, KillCursors) and kill.address == SERVER_A
    assert isinstance(resume, RunAggregate)
    assert resume.read_preference == "secondaryPreferred"
    assert isinstance(getmore2, RunGetMore) and getmore2.address == SERVER_B
    assert getmore2.command["getMore"] == Int64(2)


def test_prose_7_initial_empty_batch_with_cursor_id_stays_open() -> None:
    driver = Driver()
    driver.start(aggregate_reply(cursor_id=99))
    assert driver.machine.alive and driver.machine.cursor_id == 99
    delivered(driver.next(getmore_reply([event(1)], cursor_id=99)))
    assert driver.commands[1].command["getMore"] == Int64(99)
    assert driver.machine.cursor_id == 99


def test_prose_8_kill_cursors_failure_during_resume_is_suppressed() -> None:
    driver = Driver()
    driver.start(aggregate_reply())
    kill_failure = error(network=True, selection=True, wire=None)
    result = driver.next(resumable(), kill_failure, aggregate_reply([event(1)]))
    assert delivered(result) == event(1)
    assert driver.names() == ["aggregate", "getMore", "killCursors", "aggregate"]


def test_prose_11_empty_batch_token_is_the_post_batch_token() -> None:
    driver = Driver()
    driver.start(aggregate_reply(pbrt=token(1)))
    assert isinstance(driver.try_next(getmore_reply(pbrt=token(2))), NoDocument)
    assert driver.machine.resume_token == token(2)


def test_prose_11_iterated_to_the_last_document_token_is_the_post_batch_token() -> None:
    driver = Driver()
    driver.start(aggregate_reply())
    driver.try_next(getmore_reply([event(1), event(2), event(3)], pbrt=token(7)))
    delivered(driver.try_next())
    delivered(driver.try_next())
    assert driver.machine.resume_token == token(7)


def test_prose_13_mid_batch_token_is_the_previous_document_id() -> None:
    driver = Driver()
    driver.start(aggregate_reply())
    delivered(driver.try_next(getmore_reply([event(1), event(2), event(3)], pbrt=token(7))))
    delivered(driver.try_next())
    assert driver.machine.resume_token == token(2)


def test_prose_14_uniterated_batch_token() -> None:
    batch = [event(5), event(6)]
    for options, expected in (
        ({"start_after": token(1)}, token(1)),
        ({"resume_after": token(2)}, token(2)),
        ({}, None),
    ):
        driver = Driver(**options)
        driver.start(aggregate_reply(batch, pbrt=token(6)))
        assert driver.machine.resume_token == expected, options


def test_prose_17_start_after_without_results_resumes_with_start_after() -> None:
    driver = Driver(start_after=token(1))
    driver.start(aggregate_reply())
    driver.try_next(getmore_reply(pbrt=token(2)))
    driver.try_next(resumable(), KILLED, aggregate_reply())
    assert driver.stage() == {"startAfter": token(2)}


def test_prose_18_start_after_with_results_resumes_with_resume_after() -> None:
    driver = Driver(start_after=token(1))
    driver.start(aggregate_reply())
    delivered(driver.next(getmore_reply([event(3)])))
    driver.try_next(resumable(), KILLED, aggregate_reply())
    assert driver.stage() == {"resumeAfter": token(3)}


def _split(n: int, fragment: int, of: int, **fields: Any) -> dict[str, Any]:
    return {"_id": token(n), "splitEvent": {"fragment": fragment, "of": of}, **fields}


def test_prose_19_split_events_arrive_in_order() -> None:
    pipeline = [{"$changeStreamSplitLargeEvent": {}}]
    fragments = [_split(1, 1, 2, operationType="update"), _split(2, 2, 2, fullDocumentBeforeChange={})]
    raw = Driver(pipeline=pipeline, full_document_before_change="required")
    raw.start(aggregate_reply(fragments))
    assert [delivered(raw.next())["splitEvent"] for _ in range(2)] == [
        {"fragment": 1, "of": 2},
        {"fragment": 2, "of": 2},
    ]
    assert raw.stage() == {"fullDocumentBeforeChange": "required"}
    merged = Driver(pipeline=pipeline, reassemble_split_events=True)
    merged.start(aggregate_reply(fragments))
    assert delivered(merged.next()) == {
        "_id": token(2),
        "operationType": "update",
        "fullDocumentBeforeChange": {},
    }
