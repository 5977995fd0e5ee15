"""Unit tests of the sans-IO change-stream state machine, driven by scripted replies.

The helpers at the top (Driver, replies, errors) are reused by test_prose_machine.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from bson.int64 import Int64
from bson.timestamp import Timestamp

from changestream._machine import (
    ChangeStreamMachine,
    Command,
    Deliver,
    ErrorInfo,
    KillCursors,
    NoDocument,
    Phase,
    Raise,
    ReplyInfo,
    RunAggregate,
    RunGetMore,
    StreamSpec,
)
from changestream._options import ChangeStreamOptions
from changestream.errors import ChangeStreamError, MissingResumeTokenError, SplitEventError

SERVER_A = ("a.example", 27017)
SERVER_B = ("b.example", 27017)


def token(n: int) -> dict[str, Any]:
    """A recognisable resume token."""
    return {"_data": f"82{n:016X}"}


def event(n: int, **fields: Any) -> dict[str, Any]:
    """A change event whose ``_id`` is ``token(n)``."""
    return {"_id": token(n), "operationType": "insert", "documentKey": {"_id": n}, **fields}


def aggregate_reply(
    batch: Sequence[Mapping[str, Any]] = (),
    pbrt: Mapping[str, Any] | None = None,
    *,
    cursor_id: int = 42,
    ns: str = "db.coll",
    operation_time: Timestamp | None = None,
) -> dict[str, Any]:
    cursor: dict[str, Any] = {"firstBatch": list(batch), "id": Int64(cursor_id), "ns": ns}
    if pbrt is not None:
        cursor["postBatchResumeToken"] = pbrt
    reply: dict[str, Any] = {"cursor": cursor, "ok": 1.0}
    if operation_time is not None:
        reply["operationTime"] = operation_time
    return reply


def getmore_reply(
    batch: Sequence[Mapping[str, Any]] = (),
    pbrt: Mapping[str, Any] | None = None,
    *,
    cursor_id: int = 42,
    ns: str = "db.coll",
) -> dict[str, Any]:
    cursor: dict[str, Any] = {"nextBatch": list(batch), "id": Int64(cursor_id), "ns": ns}
    if pbrt is not None:
        cursor["postBatchResumeToken"] = pbrt
    return {"cursor": cursor, "ok": 1.0}


def error(
    code: int | None = None,
    *,
    labels: Sequence[str] = (),
    wire: int | None = 17,
    network: bool = False,
    timeout: bool = False,
    selection: bool = False,
) -> ErrorInfo:
    return ErrorInfo(
        exception=RuntimeError(f"scripted error code={code} labels={list(labels)}"),
        code=code,
        labels=frozenset(labels),
        wire_version=wire,
        is_network=network,
        is_timeout=timeout,
        is_server_selection=selection,
    )


def resumable(**kwargs: Any) -> ErrorInfo:
    return error(6, labels=["ResumableChangeStreamError"], **kwargs)


class Reply:
    """A scripted success, optionally from a given server and wire version."""

    def __init__(self, document: Mapping[str, Any], *, address: Any = SERVER_A, wire: int = 17):
        self.document = document
        self.info = ReplyInfo(address, wire)


CommandResult = Mapping[str, Any] | Reply | ErrorInfo


def make_spec(
    pipeline: list[Mapping[str, Any]] | None = None,
    *,
    database: str = "db",
    collection: str | None = "coll",
    cluster: bool = False,
    retry_reads: bool = True,
    read_preference: Any = "primary",
    decode: Any = None,
    **options: Any,
) -> StreamSpec:
    extra = {} if decode is None else {"decode": decode}
    return StreamSpec(
        database=database,
        collection=collection,
        cluster=cluster,
        options=ChangeStreamOptions.from_kwargs(pipeline, **options),
        read_preference=read_preference,
        retry_reads=retry_reads,
        **extra,
    )


class Driver:
    """Runs machine operations against scripted outcomes and records every command."""

    def __init__(self, spec: StreamSpec | None = None, **spec_kwargs: Any) -> None:
        self.machine = ChangeStreamMachine(spec if spec is not None else make_spec(**spec_kwargs))
        self.commands: list[Command] = []

    def _pump(self, outcomes: Sequence[CommandResult]) -> Deliver | NoDocument | Raise:
        pending = deque(outcomes)
        while True:
            action = self.machine.next_action()
            if isinstance(action, (Deliver, NoDocument, Raise)):
                assert not pending, f"unused scripted outcomes: {list(pending)}"
                return action
            self.commands.append(action)
            assert pending, f"no scripted outcome left for {action!r}"
            outcome = pending.popleft()
            if isinstance(outcome, ErrorInfo):
                self.machine.receive_error(outcome)
            elif isinstance(outcome, Reply):
                self.machine.receive_reply(outcome.document, outcome.info)
            else:
                self.machine.receive_reply(outcome, ReplyInfo(SERVER_A, 17))

    def start(self, *outcomes: CommandResult) -> Deliver | NoDocument | Raise:
        self.machine.start()
        return self._pump(outcomes)

    def next(self, *outcomes: CommandResult) -> Deliver | NoDocument | Raise:
        self.machine.begin_next()
        return self._pump(outcomes)

    def try_next(self, *outcomes: CommandResult) -> Deliver | NoDocument | Raise:
        self.machine.begin_try_next()
        return self._pump(outcomes)

    def close(self, *outcomes: CommandResult) -> Deliver | NoDocument | Raise:
        self.machine.close()
        return self._pump(outcomes)

    def names(self) -> list[str]:
        """Command names in order (``aggregate``, ``getMore``, ``killCursors``)."""
        return [next(iter(c.command)) for c in self.commands]

    def stage(self, index: int = -1) -> dict[str, Any]:
        """The ``$changeStream`` stage of the index-th aggregate sent."""
        aggregates = [c for c in self.commands if "aggregate" in c.command]
        result: dict[str, Any] = aggregates[index].command["pipeline"][0]["$changeStream"]
        return result


def delivered(result: Deliver | NoDocument | Raise) -> Any:
    assert isinstance(result, Deliver), f"expected a document, got {result!r}"
    return result.document


def raised(result: Deliver | NoDocument | Raise) -> BaseException:
    assert isinstance(result, Raise), f"expected an error, got {result!r}"
    return result.error


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

TS = Timestamp(1700000000, 7)


def opened(*batch: Mapping[str, Any], pbrt: Mapping[str, Any] | None = None, **kwargs: Any) -> Driver:
    """A driver whose initial aggregate returned ``batch``."""
    driver = Driver(**kwargs)
    assert isinstance(driver.start(aggregate_reply(batch, pbrt)), NoDocument)
    return driver


# -- commands -------------------------------------------------------------------------------------
class TestCommands:
    def test_collection_aggregate_sends_only_what_was_set(self) -> None:
        driver = Driver()
        driver.start(aggregate_reply())
        command = driver.commands[0]
        assert isinstance(command, RunAggregate)
        assert command.command == {
            "aggregate": "coll",
            "pipeline": [{"$changeStream": {}}],
            "cursor": {},
        }
        assert command.database == "db"
        assert not command.is_resume

    def test_every_option_goes_where_the_spec_says(self) -> None:
        driver = Driver(
            pipeline=[{"$match": {"operationType": "insert"}}],
            full_document="updateLookup",
            full_document_before_change="whenAvailable",
            show_expanded_events=True,
            batch_size=5,
            collation={"locale": "fr"},
            comment={"why": "test"},
            max_await_time_ms=250,
        )
        driver.start(aggregate_reply())
        command = driver.commands[0].command
        assert command["pipeline"] == [
            {
                "$changeStream": {
                    "fullDocument": "updateLookup",
                    "fullDocumentBeforeChange": "whenAvailable",
                    "showExpandedEvents": True,
                }
            },
            {"$match": {"operationType": "insert"}},
        ]
        assert command["cursor"] == {"batchSize": 5}
        assert command["collation"] == {"locale": "fr"}
        assert command["comment"] == {"why": "test"}
        assert "maxAwaitTimeMS" not in command and "maxTimeMS" not in command

    def test_database_and_cluster_targets(self) -> None:
        database = Driver(collection=None)
        database.start(aggregate_reply(ns="db.$cmd.aggregate"))
        assert database.commands[0].command["aggregate"] == 1
        assert database.stage() == {}
        cluster = Driver(collection=None, database="admin", cluster=True)
        cluster.start(aggregate_reply(ns="admin.$cmd.aggregate"))
        assert cluster.commands[0].database == "admin"
        assert cluster.commands[0].command["aggregate"] == 1
        assert cluster.stage() == {"allChangesForCluster": True}

    def test_getmore_uses_the_returned_namespace_and_server(self) -> None:
        driver = Driver(collection=None, max_await_time_ms=100, batch_size=3, comment="c")
        driver.start(Reply(aggregate_reply(ns="db.$cmd.aggregate", cursor_id=77), address=SERVER_B))
        driver.try_next(getmore_reply(cursor_id=77))
        getmore = driver.commands[1]
        assert isinstance(getmore, RunGetMore)
        assert getmore.command == {
            "getMore": Int64(77),
            "collection": "$cmd.aggregate",
            "batchSize": 3,
            "maxTimeMS": 100,
            "comment": "c",
        }
        assert isinstance(getmore.command["getMore"], Int64)
        assert getmore.database == "db"
        assert getmore.address == SERVER_B

    @pytest.mark.parametrize(("wire", "sent"), [(8, False), (9, True), (25, True)])
    def test_comment_on_getmore_only_from_wire_9(self, wire: int, sent: bool) -> None:
        driver = Driver(comment="hello")
        driver.start(Reply(aggregate_reply(), wire=wire))
        driver.try_next(getmore_reply())
        assert ("comment" in driver.commands[1].command) is sent

    def test_getmore_without_max_await_has_no_max_time(self) -> None:
        driver = opened()
        driver.try_next(getmore_reply())
        assert "maxTimeMS" not in driver.commands[1].command

    def test_batch_size_zero_is_not_sent_on_getmore(self) -> None:
        driver = opened(batch_size=0)
        assert driver.commands[0].command["cursor"] == {"batchSize": 0}
        driver.try_next(getmore_reply())
        assert "batchSize" not in driver.commands[1].command

    def test_conflicting_start_options_reach_the_server_verbatim(self) -> None:
        driver = Driver(resume_after=token(1), start_after=token(2), start_at_operation_time=TS)
        driver.start(aggregate_reply())
        assert driver.stage() == {
            "resumeAfter": token(1),
            "startAfter": token(2),
            "startAtOperationTime": TS,
        }

    def test_show_expanded_events_false_is_sent_when_set(self) -> None:
        driver = opened(show_expanded_events=False)
        assert driver.stage() == {"showExpandedEvents": False}

    def test_read_preference_and_concern_travel_with_every_aggregate(self) -> None:
        driver = opened(read_preference="secondary")
        driver.try_next(resumable(), {"ok": 1}, aggregate_reply())
        aggregates = [c for c in driver.commands if isinstance(c, RunAggregate)]
        assert [a.read_preference for a in aggregates] == ["secondary", "secondary"]
        assert [a.is_resume for a in aggregates] == [False, True]

    def test_kill_cursors_targets_the_cursor_server(self) -> None:
        driver = Driver()
        driver.start(Reply(aggregate_reply(cursor_id=9, ns="db.coll"), address=SERVER_B))
        assert isinstance(driver.close({"ok": 1}), NoDocument)
        kill = driver.commands[-1]
        assert isinstance(kill, KillCursors)
        assert kill.command == {"killCursors": "coll", "cursors": [Int64(9)]}
        assert kill.address == SERVER_B and kill.database == "db"


# -- resume token cache ------------------------------------------------------------------------------
class TestTokenCache:
    def test_unset_without_start_option(self) -> None:
        assert Driver().machine.resume_token is None

    def test_start_after_wins_over_resume_after(self) -> None:
        assert Driver(start_after=token(1), resume_after=token(2)).machine.resume_token == token(1)
        assert Driver(resume_after=token(2)).machine.resume_token == token(2)

    def test_empty_batch_caches_post_batch_token(self) -> None:
        driver = opened(pbrt=token(5))
        assert driver.machine.resume_token == token(5)
        driver.try_next(getmore_reply(pbrt=token(6)))
        assert driver.machine.resume_token == token(6)

    def test_empty_batch_without_post_batch_token_keeps_token(self) -> None:
        driver = opened(resume_after=token(1))
        driver.try_next(getmore_reply())
        assert driver.machine.resume_token == token(1)

    def test_non_empty_batch_does_not_cache_until_returned(self) -> None:
        driver = opened(event(1), event(2), pbrt=token(9), resume_after=token(0))
        assert driver.machine.resume_token == token(0)
        delivered(driver.try_next())
        assert driver.machine.resume_token == token(1)
        delivered(driver.try_next())
        assert driver.machine.resume_token == token(9)

    def test_last_document_without_post_batch_token_caches_its_id(self) -> None:
        driver = opened(event(1))
        delivered(driver.try_next())
        assert driver.machine.resume_token == token(1)

    def test_operation_time_saved_only_under_spec_conditions(self) -> None:
        saved = Driver()
        saved.start(aggregate_reply(operation_time=TS))
        assert saved.machine.operation_time == TS
        saved.try_next(resumable(), {"ok": 1}, aggregate_reply())
        assert saved.stage() == {"startAtOperationTime": TS}

    @pytest.mark.parametrize(
        ("kwargs", "reply", "wire"),
        [
            ({}, aggregate_reply(pbrt=token(1), operation_time=TS), 17),
            ({}, aggregate_reply([event(1)], operation_time=TS), 17),
            ({}, aggregate_reply(operation_time=TS), 6),
            ({"resume_after": token(0)}, aggregate_reply(operation_time=TS), 17),
            ({"start_after": token(0)}, aggregate_reply(operation_time=TS), 17),
        ],
    )
    def test_operation_time_not_saved(self, kwargs: dict[str, Any], reply: Any, wire: int) -> None:
        driver = Driver(**kwargs)
        driver.start(Reply(reply, wire=wire))
        assert driver.machine.operation_time is None

    def test_user_start_at_operation_time_is_kept_for_resume(self) -> None:
        driver = opened(start_at_operation_time=TS)
        driver.try_next(resumable(), {"ok": 1}, aggregate_reply())
        assert driver.stage() == {"startAtOperationTime": TS}

    def test_no_token_and_no_time_resumes_with_original_command(self) -> None:
        driver = Driver(full_document="updateLookup")
        driver.start(Reply(aggregate_reply(), wire=6))
        driver.try_next(resumable(wire=6), {"ok": 1}, aggregate_reply())
        assert driver.stage() == {"fullDocument": "updateLookup"}

    def test_token_beats_operation_time_on_resume(self) -> None:
        driver = opened(start_at_operation_time=TS)
        driver.try_next(getmore_reply(pbrt=token(3)))
        driver.try_next(resumable(), {"ok": 1}, aggregate_reply())
        assert driver.stage() == {"resumeAfter": token(3)}


# -- resumable classification ---------------------------------------------------------------------------
RESUMABLE_PRE_4_4 = [6, 7, 89, 91, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436, 63, 150,
                     13388, 234, 133]


class TestClassification:
    @pytest.mark.parametrize("code", RESUMABLE_PRE_4_4)
    def test_wire_8_allowlist(self, code: int) -> None:
        assert ChangeStreamMachine.is_resumable(error(code, wire=8))

    @pytest.mark.parametrize("code", [1, 2, 11601, 136, 237, 280, 286, 50, 216, 134])
    def test_wire_8_other_codes(self, code: int) -> None:
        assert not ChangeStreamMachine.is_resumable(error(code, wire=8))

    @pytest.mark.parametrize("code", [*RESUMABLE_PRE_4_4, 50, 280])
    def test_wire_9_needs_the_label(self, code: int) -> None:
        assert not ChangeStreamMachine.is_resumable(error(code, wire=9))
        assert ChangeStreamMachine.is_resumable(
            error(code, wire=9, labels=["ResumableChangeStreamError"])
        )

    def test_label_ignored_below_wire_9(self) -> None:
        assert not ChangeStreamMachine.is_resumable(
            error(2, wire=8, labels=["ResumableChangeStreamError"])
        )

    @pytest.mark.parametrize("wire", [6, 8, 9, 25])
    def test_cursor_not_found_always(self, wire: int) -> None:
        assert ChangeStreamMachine.is_resumable(error(43, wire=wire))

    def test_network_and_selection_errors(self) -> None:
        assert ChangeStreamMachine.is_resumable(error(network=True, wire=None))
        assert ChangeStreamMachine.is_resumable(error(network=True, selection=True, wire=None))

    def test_client_errors_without_code(self) -> None:
        assert not ChangeStreamMachine.is_resumable(error(None))
        assert not ChangeStreamMachine.is_resumable(
            error(6, wire=None, labels=["ResumableChangeStreamError"])
        )

    def test_wire_version_of_the_failing_connection_is_used(self) -> None:
        # The aggregate ran on a 4.4 server; the failing getMore's connection says 4.2.
        driver = Driver()
        driver.start(Reply(aggregate_reply(), wire=9))
        result = driver.try_next(error(189, wire=8), {"ok": 1}, aggregate_reply())
        assert isinstance(result, NoDocument)
        assert driver.names() == ["aggregate", "getMore", "killCursors", "aggregate"]

    @pytest.mark.parametrize(
        ("err", "retry"),
        [
            (error(network=True), True),
            (error(6), True),
            (error(10107), True),
            (error(134), True),
            (error(2, labels=["RetryableError"]), True),
            (error(2), False),
            (error(43), False),
            (error(network=True, selection=True), False),
            (error(network=True, timeout=True), False),
        ],
    )
    def test_retryable_read_table(self, err: ErrorInfo, retry: bool) -> None:
        assert Driver().machine.is_retryable_read(err) is retry
        assert Driver(retry_reads=False).machine.is_retryable_read(err) is False


# -- initial aggregate retry and aggregate failures -----------------------------------------------------------
class TestAggregateFailures:
    def test_initial_aggregate_retried_once(self) -> None:
        driver = Driver()
        assert isinstance(driver.start(error(network=True), aggregate_reply()), NoDocument)
        assert [c.attempt for c in driver.commands if isinstance(c, RunAggregate)] == [1, 2]
        assert driver.commands[0].command == driver.commands[1].command
        assert driver.machine.alive

    def test_second_failure_is_raised(self) -> None:
        driver = Driver()
        second = error(91)
        assert raised(driver.start(error(6), second)) is second.exception
        assert not driver.machine.alive

    def test_no_retry_when_retry_reads_disabled(self) -> None:
        driver = Driver(retry_reads=False)
        raised(driver.start(error(network=True)))
        assert driver.names() == ["aggregate"]

    def test_non_retryable_aggregate_error_is_raised_and_closes(self) -> None:
        driver = Driver()
        failure = error(40324)
        assert raised(driver.start(failure)) is failure.exception
        assert driver.names() == ["aggregate"]
        assert driver.machine.phase is Phase.CLOSED
        assert isinstance(driver.next(), NoDocument)
        assert driver.names() == ["aggregate"]

    def test_resume_aggregate_failure_is_not_resumed(self) -> None:
        driver = opened()
        failure = error(280, labels=["NonResumableChangeStreamError"])
        assert raised(driver.next(resumable(), {"ok": 1}, failure)) is failure.exception
        assert driver.names() == ["aggregate", "getMore", "killCursors", "aggregate"]
        assert not driver.machine.alive

    def test_resume_aggregate_also_gets_one_retry(self) -> None:
        driver = opened()
        result = driver.try_next(resumable(), {"ok": 1}, error(network=True),
                                 aggregate_reply([event(1)]))
        assert delivered(result) == event(1)
        assert driver.names() == ["aggregate", "getMore", "killCursors", "aggregate", "aggregate"]


# -- resume process ----------------------------------------------------------------------------------------------
class TestResume:
    def test_consecutive_resumes_when_each_aggregate_succeeds(self) -> None:
        driver = opened()
        result = driver.next(
            resumable(), {"ok": 1}, aggregate_reply(cursor_id=43),
            resumable(), {"ok": 1}, aggregate_reply(cursor_id=44),
            getmore_reply([event(1)], cursor_id=44),
        )
        assert delivered(result) == event(1)
        assert driver.names() == [
            "aggregate", "getMore", "killCursors", "aggregate", "getMore", "killCursors",
            "aggregate", "getMore",
        ]
        kills = [c for c in driver.commands if isinstance(c, KillCursors)]
        assert [k.command["cursors"] for k in kills] == [[Int64(42)], [Int64(43)]]

    def test_kill_errors_are_suppressed(self) -> None:
        driver = opened()
        result = driver.try_next(resumable(), error(network=True), aggregate_reply([event(1)]))
        assert delivered(result) == event(1)

    def test_cursor_not_found_still_kills_best_effort_then_resumes(self) -> None:
        driver = opened()
        driver.try_next(getmore_reply(cursor_id=42))
        driver.try_next(error(43), {"ok": 1}, aggregate_reply())
        assert driver.names()[-2:] == ["killCursors", "aggregate"]

    def test_try_next_one_getmore_and_first_batch_only_after_resume(self) -> None:
        driver = opened()
        assert isinstance(driver.try_next(resumable(), {"ok": 1}, aggregate_reply()), NoDocument)
        assert driver.names() == ["aggregate", "getMore", "killCursors", "aggregate"]
        assert isinstance(driver.try_next(getmore_reply()), NoDocument)
        assert driver.names()[-1] == "getMore"

    def test_try_next_resumes_at_most_once(self) -> None:
        driver = opened()
        failure = error(2)
        driver.try_next(resumable(), {"ok": 1}, aggregate_reply())
        # A second getMore failure in the next call is a fresh error: resumes again.
        driver.try_next(resumable(), {"ok": 1}, aggregate_reply())
        assert driver.names().count("aggregate") == 3
        assert raised(driver.try_next(failure, {"ok": 1})) is failure.exception

    def test_non_resumable_getmore_error_kills_and_closes(self) -> None:
        driver = opened(resume_after=token(1))
        failure = error(2)
        assert raised(driver.next(failure, {"ok": 1})) is failure.exception
        assert driver.names() == ["aggregate", "getMore", "killCursors"]
        assert not driver.machine.alive
        assert driver.machine.resume_token == token(1)

    def test_resume_discards_nothing_buffered_and_uses_new_cursor(self) -> None:
        driver = opened()
        driver.try_next(resumable(), {"ok": 1},
                        Reply(aggregate_reply(cursor_id=50), address=SERVER_B))
        driver.try_next(getmore_reply(cursor_id=50))
        getmore = driver.commands[-1]
        assert getmore.command["getMore"] == Int64(50) and getmore.address == SERVER_B


# -- client-side timeouts (CSOT) ----------------------------------------------------------------------------
class TestTimeouts:
    def test_getmore_timeout_keeps_stream_and_next_call_resumes_first(self) -> None:
        driver = opened(pbrt=token(1))
        timeout = error(network=True, timeout=True, wire=17)
        assert raised(driver.next(timeout)) is timeout.exception
        assert driver.machine.alive and driver.machine.phase is Phase.RESUME_PENDING
        assert driver.names() == ["aggregate", "getMore"]
        result = driver.try_next({"ok": 1}, aggregate_reply(), getmore_reply([event(2)]))
        assert delivered(result) == event(2)
        assert driver.names()[2:] == ["killCursors", "aggregate", "getMore"]
        assert driver.stage() == {"resumeAfter": token(1)}

    def test_resumable_error_with_expired_deadline_is_not_resumed_now(self) -> None:
        driver = opened()
        expired = error(43, timeout=True)
        assert raised(driver.try_next(expired)) is expired.exception
        assert driver.names() == ["aggregate", "getMore"]
        assert driver.machine.alive

    def test_resume_aggregate_timeout_keeps_stream(self) -> None:
        driver = opened()
        timeout = error(network=True, timeout=True)
        assert raised(driver.try_next(resumable(), {"ok": 1}, timeout)) is timeout.exception
        assert driver.machine.phase is Phase.RESUME_PENDING
        driver.try_next(aggregate_reply(), getmore_reply())
        # The old cursor was already killed: straight to the aggregate.
        assert driver.names()[-3:] == ["aggregate", "aggregate", "getMore"]

    def test_initial_aggregate_timeout_fails_watch(self) -> None:
        driver = Driver()
        timeout = error(network=True, timeout=True)
        assert raised(driver.start(timeout)) is timeout.exception
        assert driver.names() == ["aggregate"]
        assert not driver.machine.alive

    def test_server_timeout_with_label_resumes_without_csot(self) -> None:
        driver = opened()
        driver.try_next(error(50, labels=["ResumableChangeStreamError"]), {"ok": 1},
                        aggregate_reply())
        assert driver.names()[-1] == "aggregate"


# -- end of stream -----------------------------------------------------------------------------------------
class TestEnd:
    def test_invalidate_is_returned_then_the_stream_closes(self) -> None:
        invalidate = {"_id": token(9), "operationType": "invalidate"}
        driver = opened()
        first = driver.next(getmore_reply([event(1), invalidate], pbrt=token(9), cursor_id=0))
        assert delivered(first) == event(1)
        assert driver.machine.alive
        assert delivered(driver.next()) == invalidate
        assert not driver.machine.alive
        assert driver.machine.resume_token == token(9)
        assert isinstance(driver.next(), NoDocument)
        assert isinstance(driver.close(), NoDocument)
        assert driver.names() == ["aggregate", "getMore"]

    def test_cursor_closed_with_empty_batch_ends_iteration(self) -> None:
        driver = opened()
        assert isinstance(driver.next(getmore_reply(pbrt=token(3), cursor_id=0)), NoDocument)
        assert not driver.machine.alive
        assert driver.machine.resume_token == token(3)

    def test_missing_id_raises_closes_and_keeps_token(self) -> None:
        driver = opened({"operationType": "insert"}, resume_after=token(1))
        err = raised(driver.next({"ok": 1}))
        assert isinstance(err, MissingResumeTokenError)
        assert str(err) == "Cannot provide resume functionality when the resume token is missing."
        assert driver.names() == ["aggregate", "killCursors"]
        assert not driver.machine.alive
        assert driver.machine.resume_token == token(1)

    def test_close_is_idempotent_and_keeps_token(self) -> None:
        driver = opened(pbrt=token(4))
        driver.close({"ok": 1})
        driver.close()
        assert driver.names() == ["aggregate", "killCursors"]
        assert driver.machine.resume_token == token(4)

    def test_close_after_timeout_kills_the_old_cursor(self) -> None:
        driver = opened()
        driver.next(error(network=True, timeout=True))
        driver.close({"ok": 1})
        assert driver.names() == ["aggregate", "getMore", "killCursors"]

    def test_abort_mid_command_kills_and_closes(self) -> None:
        driver = opened(pbrt=token(2))
        driver.machine.begin_next()
        assert isinstance(driver.machine.next_action(), RunGetMore)
        driver.machine.abort()
        kill = driver.machine.next_action()
        assert isinstance(kill, KillCursors)
        driver.machine.receive_error(error(network=True))
        assert isinstance(driver.machine.next_action(), NoDocument)
        assert not driver.machine.alive
        assert driver.machine.resume_token == token(2)

    def test_abandon_hands_over_the_open_cursor_once_without_io(self) -> None:
        driver = opened(event(1), event(2), pbrt=token(2))
        delivered(driver.next())
        kill = driver.machine.abandon()
        assert isinstance(kill, KillCursors)
        assert kill.command == {"killCursors": "coll", "cursors": [Int64(42)]}
        assert (kill.database, kill.address) == ("db", SERVER_A)
        assert not driver.machine.alive
        assert driver.machine.resume_token == token(1)
        assert driver.machine.abandon() is None, "the cursor is handed over only once"
        assert isinstance(driver.next(), NoDocument)
        assert driver.names() == ["aggregate"], "abandon sends nothing itself"

    def test_abandon_without_a_live_cursor_has_nothing_to_kill(self) -> None:
        assert Driver().machine.abandon() is None
        driver = opened()
        driver.next(getmore_reply(pbrt=token(3), cursor_id=0))
        assert driver.machine.abandon() is None

    def test_malformed_reply_is_a_clear_error(self) -> None:
        driver = opened()
        err = raised(driver.try_next({"ok": 1, "cursor": {"id": Int64(42)}}, {"ok": 1}))
        assert isinstance(err, ChangeStreamError)
        assert "malformed getMore reply" in str(err)
        assert not driver.machine.alive

    def test_decode_failure_closes_without_advancing_token(self) -> None:
        def decode(document: Mapping[str, Any]) -> Any:
            if document["documentKey"]["_id"] == 2:
                raise ValueError("undecodable")
            return document

        driver = opened(event(1), event(2), decode=decode)
        delivered(driver.try_next())
        err = raised(driver.try_next({"ok": 1}))
        assert isinstance(err, ValueError)
        assert driver.machine.resume_token == token(1)

    def test_protocol_misuse_is_rejected(self) -> None:
        driver = Driver()
        with pytest.raises(RuntimeError):
            driver.machine.begin_next()
        with pytest.raises(RuntimeError):
            driver.machine.next_action()
        driver.machine.start()
        driver.machine.next_action()
        with pytest.raises(RuntimeError):
            driver.machine.next_action()
        with pytest.raises(RuntimeError):
            driver.machine.close()


# -- split events ---------------------------------------------------------------------------------------------
def fragment(n: int, index: int, of: int, **fields: Any) -> dict[str, Any]:
    return {"_id": token(n), "splitEvent": {"fragment": index, "of": of}, **fields}


class TestSplitReassembly:
    def test_fragments_across_batches_merge_into_one_event(self) -> None:
        driver = opened(fragment(1, 1, 3, operationType="update", a=1), pbrt=token(1),
                        reassemble_split_events=True, resume_after=token(0))
        # The token stays before the first fragment while the run is incomplete.
        result = driver.next(
            getmore_reply([fragment(2, 2, 3, b=2)], pbrt=token(2)),
            getmore_reply(pbrt=token(2)),
            getmore_reply([fragment(3, 3, 3, c=3), event(4)], pbrt=token(4)),
        )
        assert delivered(result) == {"_id": token(3), "operationType": "update", "a": 1, "b": 2,
                                     "c": 3}
        assert driver.machine.resume_token == token(3)
        assert delivered(driver.next()) == event(4)
        assert driver.machine.resume_token == token(4)

    def test_token_does_not_move_during_an_incomplete_run(self) -> None:
        driver = opened(fragment(1, 1, 2), pbrt=token(1), reassemble_split_events=True,
                        resume_after=token(0))
        assert isinstance(driver.try_next(getmore_reply(pbrt=token(1))), NoDocument)
        assert driver.machine.resume_token == token(0)
        assert isinstance(driver.try_next(getmore_reply(pbrt=token(1))), NoDocument)
        assert driver.machine.resume_token == token(0)

    def test_resume_mid_run_redelivers_the_whole_event_once(self) -> None:
        driver = opened(reassemble_split_events=True, pbrt=token(0))
        driver.try_next(getmore_reply([fragment(1, 1, 2, a=1)], pbrt=token(1)))
        result = driver.next(
            resumable(), {"ok": 1},
            aggregate_reply([fragment(1, 1, 2, a=1), fragment(2, 2, 2, b=2)], pbrt=token(2)),
        )
        assert driver.stage() == {"resumeAfter": token(0)}
        assert delivered(result) == {"_id": token(2), "a": 1, "b": 2}
        assert driver.machine.resume_token == token(2)
        assert isinstance(driver.try_next(getmore_reply(pbrt=token(2))), NoDocument)

    def test_out_of_order_fragments_raise_and_close(self) -> None:
        driver = opened(fragment(1, 1, 3), fragment(3, 3, 3), reassemble_split_events=True)
        err = raised(driver.next({"ok": 1}))
        assert isinstance(err, SplitEventError)
        assert "expected fragment 2 of 3" in str(err)
        assert not driver.machine.alive

    def test_cursor_closing_mid_run_is_an_error(self) -> None:
        driver = opened(fragment(1, 1, 2), reassemble_split_events=True)
        err = raised(driver.next(getmore_reply(cursor_id=0)))
        assert isinstance(err, SplitEventError)

    def test_without_reassembly_fragments_are_plain_events(self) -> None:
        driver = opened(fragment(1, 1, 2), fragment(2, 2, 2))
        assert delivered(driver.next())["splitEvent"] == {"fragment": 1, "of": 2}
        assert driver.machine.resume_token == token(1)
