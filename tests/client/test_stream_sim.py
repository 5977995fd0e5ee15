"""The prose tests and CSOT/resume behaviour end to end: ``changestream.watch`` over PyMongo.

Runs against the ``changestream.testing`` replica-set simulator, or against a
real replica set when ``MONGODB_URI`` is set (tests that need to drive the
simulator itself, such as a failover, are then skipped). ``deployment``,
``recorder``, ``admin`` and ``names`` are shared with ``tests/aio`` through
``tests/conftest.py``; ``Recorder`` and ``plain`` live in ``tests/support.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import bson
import pytest
from bson.raw_bson import RawBSONDocument
from pymongo import MongoClient, ReadPreference, monitoring
from pymongo.errors import OperationFailure, PyMongoError
from support import (
    STREAM_COMMANDS,
    Deployment,
    Recorder,
    interrupt_as_a_getmore_is_chosen,
    plain,
)

import changestream
from changestream.errors import MissingResumeTokenError

FAST = {"max_await_time_ms": 50}
"""Keep idle getMores short so try_next() returns quickly."""


# -- fixtures (``deployment``, ``recorder``, ``admin``, ``names`` come from tests/conftest.py) -----
@pytest.fixture
def client(deployment: Deployment, recorder: Recorder) -> Iterator[MongoClient[dict[str, Any]]]:
    """The observed client the streams run on."""
    mongo: MongoClient[dict[str, Any]] = MongoClient(
        deployment.uri, event_listeners=[recorder], serverSelectionTimeoutMS=5000
    )
    yield mongo
    mongo.close()


@pytest.fixture
def coll(client: MongoClient[dict[str, Any]], names: tuple[str, str]) -> Any:
    return client[names[0]][names[1]]


@pytest.fixture
def writer(admin: MongoClient[dict[str, Any]], names: tuple[str, str]) -> Any:
    return admin[names[0]][names[1]]


def fail_point(admin: MongoClient[dict[str, Any]], name: str, mode: Any, **data: Any) -> None:
    admin.admin.command({"configureFailPoint": name, "mode": mode, "data": data})


def resumable_getmore_failure(admin: MongoClient[dict[str, Any]]) -> None:
    """One getMore fails with a resumable error (the label is computed server-side)."""
    fail_point(admin, "failGetMoreAfterCursorCheckout", {"times": 1}, errorCode=6)


VOLATILE = {"lsid", "$clusterTime", "$db", "maxTimeMS", "$readPreference"}


def address(event: monitoring.CommandStartedEvent) -> str:
    host, port = event.connection_id
    return f"{host}:{port}"


def drain(stream: changestream.ChangeStream[Any], count: int) -> list[Any]:
    return [stream.next() for _ in range(count)]


# -- helpers and commands ---------------------------------------------------------------------
def test_watch_targets_send_the_spec_commands(client: Any, coll: Any, writer: Any,
                                              recorder: Recorder) -> None:
    with changestream.watch(coll, [{"$match": {"operationType": "insert"}}], **FAST) as stream:
        writer.insert_one({"x": 1})
        assert stream.next()["fullDocument"]["x"] == 1
    aggregate = recorder.commands("aggregate")[0]
    assert aggregate["aggregate"] == coll.name and aggregate["cursor"] == {}
    assert aggregate["pipeline"] == [{"$changeStream": {}}, {"$match": {"operationType": "insert"}}]
    with changestream.Client(client)[coll.database.name].watch(**FAST) as stream:
        writer.insert_one({"x": 2})
        assert stream.next()["ns"] == {"db": coll.database.name, "coll": coll.name}
    assert recorder.commands("aggregate")[-1]["aggregate"] == 1
    assert recorder.commands("getMore")[-1]["collection"] == "$cmd.aggregate"
    with changestream.watch(client, **FAST) as stream:
        writer.insert_one({"x": 3})
        assert stream.next()["fullDocument"]["x"] == 3
    cluster = [e for e in recorder.events if e.command_name == "aggregate"][-1]
    assert cluster.database_name == "admin"
    assert recorder.stage() == {"allChangesForCluster": True}


def test_iteration_and_one_session_for_every_command(coll: Any, writer: Any,
                                                     recorder: Recorder) -> None:
    stream = changestream.watch(coll, batch_size=2, **FAST)
    writer.insert_many([{"i": i} for i in range(5)])
    seen = []
    for change in stream:
        seen.append(change["fullDocument"]["i"])
        if len(seen) == 5:
            break
    stream.close()
    assert seen == [0, 1, 2, 3, 4]
    assert not stream.alive
    assert recorder.commands("aggregate")[0]["cursor"] == {"batchSize": 2}
    assert all(c["batchSize"] == 2 for c in recorder.commands("getMore"))
    assert recorder.names()[-1] == "killCursors"
    assert len({e.command["lsid"]["id"] for e in recorder.events}) == 1
    with pytest.raises(StopIteration):
        stream.next()


# -- prose tests --------------------------------------------------------------------------------
def test_prose_1_tracks_the_last_seen_resume_token(coll: Any, writer: Any,
                                                   recorder: Recorder) -> None:
    with changestream.watch(coll, **FAST) as stream:
        assert stream.resume_token == recorder.last_pbrt()
        writer.insert_many([{"i": 1}, {"i": 2}])
        first = stream.next()
        if stream._machine.buffered:
            assert stream.resume_token == first["_id"]
            stream.next()
        assert stream.resume_token == recorder.last_pbrt()
        assert stream.try_next() is None
        assert stream.resume_token == recorder.last_pbrt()


def test_prose_2_missing_resume_token_raises_and_closes(coll: Any, writer: Any) -> None:
    stream = changestream.watch(coll, [{"$project": {"_id": 0}}], **FAST)
    writer.insert_one({"x": 1})
    with pytest.raises((OperationFailure, MissingResumeTokenError)) as info:
        stream.next()
    if isinstance(info.value, OperationFailure):
        assert info.value.code == 280
    assert not stream.alive


def test_prose_3_resumes_once_with_the_initial_pipeline(admin: Any, coll: Any, writer: Any,
                                                        recorder: Recorder) -> None:
    pipeline = [{"$match": {"operationType": "insert"}}]
    with changestream.watch(coll, pipeline, full_document="updateLookup", **FAST) as stream:
        writer.insert_one({"x": 1})
        stream.next()
        token = stream.resume_token
        resumable_getmore_failure(admin)
        writer.insert_one({"x": 2})
        assert stream.next()["fullDocument"]["x"] == 2
    first, resumed = (plain(c) for c in recorder.commands("aggregate"))
    assert resumed["pipeline"][1:] == pipeline
    assert resumed["pipeline"][0] == {
        "$changeStream": {"fullDocument": "updateLookup", "resumeAfter": token}
    }
    assert {k: v for k, v in resumed.items() if k not in VOLATILE | {"pipeline"}} == {
        k: v for k, v in first.items() if k not in VOLATILE | {"pipeline"}
    }
    assert recorder.names()[-3:] == ["killCursors", "aggregate", "killCursors"]


def test_prose_4_no_resume_after_an_aggregate_error(admin: Any, coll: Any,
                                                    recorder: Recorder) -> None:
    fail_point(admin, "failCommand", {"times": 1}, failCommands=["aggregate"], errorCode=2)
    with pytest.raises(OperationFailure) as info:
        changestream.watch(coll, **FAST)
    assert info.value.code == 2
    assert recorder.names() == ["aggregate"]


def test_prose_6_resume_selects_with_the_original_read_preference(
    deployment: Deployment, coll: Any, writer: Any, recorder: Recorder
) -> None:
    sim = deployment.require_sim()
    primary = sim.primary
    with changestream.watch(coll, read_preference=ReadPreference.SECONDARY, **FAST) as stream:
        writer.insert_one({"x": 1})
        stream.next()
        sim.kill_cursors()
        writer.insert_one({"x": 2})
        assert stream.next()["fullDocument"]["x"] == 2
    addresses: dict[str, list[str]] = {name: [] for name in STREAM_COMMANDS}
    for e in recorder.events:
        addresses[e.command_name].append(address(e))
    assert len(addresses["aggregate"]) == 2
    assert primary not in addresses["aggregate"] + addresses["getMore"]


def test_prose_7_initial_empty_batch_is_not_closed(coll: Any, writer: Any,
                                                   recorder: Recorder) -> None:
    with changestream.watch(coll, **FAST) as stream:
        reply = recorder.replies[0][1]["cursor"]
        assert reply["firstBatch"] == [] and reply["id"] != 0
        assert stream.alive
        writer.insert_one({"x": 1})
        stream.next()
        assert recorder.commands("getMore")[0]["getMore"] == reply["id"]


def test_prose_8_kill_cursors_error_during_resume_is_suppressed(admin: Any, coll: Any,
                                                                writer: Any) -> None:
    with changestream.watch(coll, **FAST) as stream:
        fail_point(admin, "failCommand", {"times": 1}, failCommands=["killCursors"], errorCode=2)
        resumable_getmore_failure(admin)
        writer.insert_one({"x": 1})
        assert stream.next()["fullDocument"]["x"] == 1


def test_prose_11_token_is_post_batch_token_for_empty_and_exhausted_batches(
    coll: Any, writer: Any, recorder: Recorder
) -> None:
    with changestream.watch(coll, **FAST) as stream:
        assert stream.try_next() is None
        assert stream.resume_token == recorder.last_pbrt()
        writer.insert_many([{"i": i} for i in range(3)])
        while stream.try_next() is not None or stream._machine.buffered:
            pass
        assert stream.resume_token == recorder.last_pbrt()


def test_prose_13_mid_batch_token_is_the_previous_id(coll: Any, writer: Any) -> None:
    with changestream.watch(coll, **FAST) as stream:
        writer.insert_many([{"i": i} for i in range(3, 6)])
        first = stream.next()
        assert stream._machine.buffered, "the three inserts should arrive in one batch"
        second = stream.next()
        assert stream.resume_token == second["_id"] != first["_id"]


def test_prose_14_uniterated_batch_token(coll: Any, writer: Any) -> None:
    with changestream.watch(coll, **FAST) as stream:
        writer.insert_many([{"i": i} for i in range(3)])
        first = stream.next()
    with changestream.watch(coll, resume_after=first["_id"], **FAST) as resumed:
        assert resumed._machine.buffered > 0
        assert resumed.resume_token == first["_id"]
    with changestream.watch(coll, start_after=first["_id"], **FAST) as started:
        assert started._machine.buffered > 0
        assert started.resume_token == first["_id"]


def test_prose_17_start_after_without_results_resumes_with_start_after(
    admin: Any, coll: Any, writer: Any, recorder: Recorder
) -> None:
    with changestream.watch(coll, **FAST) as stream:
        writer.insert_one({"x": 1})
        token = stream.next()["_id"]
    recorder.clear()
    with changestream.watch(coll, start_after=token, **FAST) as stream:
        assert stream.try_next() is None
        resumable_getmore_failure(admin)
        stream.try_next()
    stage = recorder.stage()
    assert "startAfter" in stage and "resumeAfter" not in stage


def test_prose_18_start_after_with_results_resumes_with_resume_after(
    admin: Any, coll: Any, writer: Any, recorder: Recorder
) -> None:
    with changestream.watch(coll, **FAST) as stream:
        writer.insert_one({"x": 1})
        token = stream.next()["_id"]
    recorder.clear()
    with changestream.watch(coll, start_after=token, **FAST) as stream:
        writer.insert_one({"x": 2})
        stream.next()
        resumable_getmore_failure(admin)
        stream.try_next()
    stage = recorder.stage()
    assert "resumeAfter" in stage and "startAfter" not in stage


BIG = 10 * 1024 * 1024


def _split_setup(admin: Any, coll: Any) -> Any:
    database = admin[coll.database.name]
    database.drop_collection(coll.name)
    database.create_collection(coll.name, changeStreamPreAndPostImages={"enabled": True})
    database[coll.name].insert_one({"_id": 1, "value": "q" * BIG})
    return database[coll.name]


def test_prose_19_large_events_are_split(admin: Any, coll: Any) -> None:
    writer = _split_setup(admin, coll)
    with changestream.watch(coll, [{"$changeStreamSplitLargeEvent": {}}],
                            full_document_before_change="required", **FAST) as stream:
        writer.update_one({}, {"$set": {"value": "z" * BIG}})
        fragments = drain(stream, 2)
    assert [f["splitEvent"] for f in fragments] == [
        {"fragment": 1, "of": 2},
        {"fragment": 2, "of": 2},
    ]


def test_split_reassembly_survives_a_resume_mid_event(admin: Any, coll: Any,
                                                      recorder: Recorder) -> None:
    writer = _split_setup(admin, coll)
    armed = threading.Event()

    def fail_after_first_fragment(event: monitoring.CommandSucceededEvent) -> None:
        batch = event.reply["cursor"].get("nextBatch") or []
        if event.command_name == "getMore" and batch and not armed.is_set():
            armed.set()
            resumable_getmore_failure(admin)

    with changestream.watch(coll, [{"$changeStreamSplitLargeEvent": {}}], batch_size=1,
                            full_document_before_change="required", reassemble_split_events=True,
                            **FAST) as stream:
        before = stream.resume_token
        recorder.on_success = fail_after_first_fragment
        writer.update_one({}, {"$set": {"value": "z" * BIG}})
        merged = stream.next()
        recorder.on_success = None
        assert armed.is_set()
        assert "splitEvent" not in merged
        assert len(merged["fullDocumentBeforeChange"]["value"]) == BIG
        assert merged["updateDescription"]["updatedFields"]["value"] == "z" * BIG
        assert plain(recorder.stage()["resumeAfter"]) == before
        assert stream.try_next() is None


# -- CSOT -------------------------------------------------------------------------------------
def test_timeout_keeps_the_stream_and_the_next_call_resumes(admin: Any, coll: Any, writer: Any,
                                                            recorder: Recorder) -> None:
    with changestream.watch(coll, timeout_ms=300, max_await_time_ms=50) as stream:
        fail_point(admin, "failCommand", {"times": 1}, failCommands=["getMore"],
                   blockConnection=True, blockTimeMS=500)
        with pytest.raises(PyMongoError) as info:
            stream.next()
        assert info.value.timeout
        assert stream.alive
        writer.insert_one({"x": 1})
        assert stream.next()["fullDocument"]["x"] == 1
    # The second call resumes first; the insert comes back in the new aggregate's first batch.
    names = [n for n in recorder.names() if n != "killCursors"]
    assert names[:3] == ["aggregate", "getMore", "aggregate"]
    assert "maxTimeMS" in recorder.commands("aggregate")[0]
    assert all(c["maxTimeMS"] <= 50 for c in recorder.commands("getMore"))


def test_getmore_has_no_max_time_without_max_await(coll: Any, recorder: Recorder) -> None:
    with changestream.watch(coll, timeout_ms=3000) as stream:
        assert stream.try_next() is None
    assert "maxTimeMS" in recorder.commands("aggregate")[0]
    assert "maxTimeMS" not in recorder.commands("getMore")[0]


# -- end of stream, documents and tokens -------------------------------------------------------------
def test_invalidate_closes_and_its_token_starts_a_new_stream(coll: Any, writer: Any) -> None:
    stream = changestream.watch(coll, **FAST)
    writer.drop()
    events = list(stream)
    assert [e["operationType"] for e in events] == ["drop", "invalidate"]
    assert not stream.alive
    assert stream.resume_token == events[-1]["_id"]
    writer.insert_one({"x": 1})
    with changestream.watch(coll, start_after=stream.resume_token, **FAST) as again:
        assert again.next()["operationType"] == "insert"


def test_resume_after_the_server_lost_the_cursor(deployment: Deployment, coll: Any,
                                                 writer: Any, recorder: Recorder) -> None:
    sim = deployment.require_sim()
    with changestream.watch(coll, **FAST) as stream:
        assert stream.try_next() is None
        sim.kill_cursors()
        writer.insert_one({"x": 1})
        assert stream.next()["fullDocument"]["x"] == 1
    assert recorder.names().count("aggregate") == 2


def test_failover_resumes_on_the_new_primary(deployment: Deployment, coll: Any, writer: Any,
                                             recorder: Recorder) -> None:
    sim = deployment.require_sim()
    with changestream.watch(coll, **FAST) as stream:
        writer.insert_one({"x": 1})
        stream.next()
        new_primary = sim.step_down()
        writer.insert_one({"x": 2})
        assert stream.next()["fullDocument"]["x"] == 2
    resume = [e for e in recorder.events if e.command_name == "aggregate"][-1]
    assert address(resume) == new_primary


def test_typed_events_and_raw_documents(coll: Any, writer: Any) -> None:
    from changestream import events

    with changestream.watch(coll, typed=True, **FAST) as typed:
        writer.insert_one({"x": 1})
        change = typed.next()
        assert isinstance(change, events.InsertEvent)
    with changestream.watch(coll, document_class=RawBSONDocument, **FAST) as raw:
        writer.insert_one({"x": 2})
        change = raw.next()
        assert isinstance(change, RawBSONDocument)
        token = raw.resume_token
        assert isinstance(token, RawBSONDocument)
        writer.insert_one({"x": 3})
    with changestream.watch(coll, resume_after=token, **FAST) as resumed:
        assert resumed.next()["fullDocument"]["x"] == 3


def test_collation_and_comment_are_sent(coll: Any, recorder: Recorder) -> None:
    with changestream.watch(coll, collation={"locale": "en"}, comment="hi", **FAST) as stream:
        stream.try_next()
    aggregate = recorder.commands("aggregate")[0]
    assert aggregate["collation"] == {"locale": "en"} and aggregate["comment"] == "hi"
    assert recorder.commands("getMore")[0]["comment"] == "hi"


# -- closing and interruption --------------------------------------------------------------------
def test_close_from_another_thread_stops_a_blocked_next(coll: Any, recorder: Recorder) -> None:
    stream = changestream.watch(coll, **FAST)
    outcome: list[Any] = []

    def consume() -> None:
        try:
            outcome.append(stream.next())
        except StopIteration:
            outcome.append("stopped")

    thread = threading.Thread(target=consume)
    thread.start()
    while recorder.names().count("getMore") < 2:
        thread.join(0.01)
    stream.close()
    thread.join(5)
    assert not thread.is_alive()
    assert outcome == ["stopped"]
    assert not stream.alive and recorder.names()[-1] == "killCursors"


def test_keyboard_interrupt_kills_the_cursor_and_keeps_the_token(coll: Any,
                                                                 recorder: Recorder) -> None:
    stream = changestream.watch(coll, **FAST)
    assert stream.try_next() is None
    token = stream.resume_token

    def interrupt(event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name == "getMore":
            raise KeyboardInterrupt

    recorder.on_success = interrupt
    with pytest.raises(KeyboardInterrupt):
        stream.next()
    recorder.on_success = None
    assert not stream.alive
    assert stream.resume_token == token
    assert recorder.names()[-1] == "killCursors"
    assert stream.try_next() is None


def test_an_interrupt_just_after_a_getmore_was_chosen_still_closes_the_stream(
        coll: Any, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C lands between the machine choosing a getMore and the shell sending it (a
    signal is handled between any two bytecodes): that getMore must not stay "in flight",
    else close() refuses with a RuntimeError and the cursor is never killed."""
    stream = changestream.watch(coll, **FAST)
    assert stream.try_next() is None
    token = stream.resume_token
    cursor_id = stream._machine.cursor_id
    interrupt_as_a_getmore_is_chosen(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        stream.next()
    monkeypatch.undo()
    stream.close()  # raised RuntimeError: the getMore was still in flight
    assert not stream.alive and stream.resume_token == token
    assert [k["cursors"] for k in recorder.commands("killCursors")] == [[cursor_id]]


def test_client_wrapper_from_uri(deployment: Deployment, names: tuple[str, str],
                                 writer: Any) -> None:
    with changestream.Client(deployment.uri, serverSelectionTimeoutMS=5000) as client:
        collection = client[names[0]].coll
        assert isinstance(collection, changestream.Collection)
        assert collection.pymongo.full_name == f"{names[0]}.coll"
        with collection.watch(**FAST) as stream:
            writer.insert_one({"x": 1})
            assert stream.next()["fullDocument"]["x"] == 1


class SdamRecorder(monitoring.ServerListener):
    """Records server descriptions that changed to Unknown."""

    def __init__(self) -> None:
        self.unknown: list[tuple[str, int]] = []

    def opened(self, event: monitoring.ServerOpeningEvent) -> None:
        pass

    def closed(self, event: monitoring.ServerClosedEvent) -> None:
        pass

    def description_changed(self, event: monitoring.ServerDescriptionChangedEvent) -> None:
        if event.new_description.server_type_name == "Unknown":
            self.unknown.append(event.server_address)


@pytest.mark.parametrize(
    ("failure", "marks_unknown"),
    [
        # The reply carries the server's current topologyVersion: SDAM ignores it as stale,
        # exactly as for PyMongo's own operations.
        ({"errorCode": 10107}, False),
        ({"closeConnection": True}, True),
    ],
)
def test_initial_aggregate_retry_and_sdam_error_handling(
    deployment: Deployment,
    admin: Any,
    names: tuple[str, str],
    failure: dict[str, Any],
    marks_unknown: bool,
) -> None:
    recorder, sdam = Recorder(), SdamRecorder()
    # A short heartbeat: after "not primary" the monitor rediscovers the primary quickly.
    with MongoClient(deployment.uri, event_listeners=[recorder, sdam], heartbeatFrequencyMS=500,
                     serverSelectionTimeoutMS=5000) as client:
        client.admin.command("ping")
        primary = client.primary
        fail_point(admin, "failCommand", {"times": 1}, failCommands=["aggregate"], **failure)
        with changestream.watch(client[names[0]][names[1]], **FAST) as stream:
            assert stream.alive
        assert recorder.names()[:2] == ["aggregate", "aggregate"]
        # SDAM events are published by a background thread.
        for _ in range(200 if marks_unknown else 50):
            if primary in sdam.unknown:
                break
            threading.Event().wait(0.01)
        assert (primary in sdam.unknown) is marks_unknown


def test_pymongo_timeout_block_replaces_the_client_timeout(
    deployment: Deployment, admin: Any, names: tuple[str, str]
) -> None:
    import pymongo

    # The client's timeoutMS (1 s) also bounds opening the stream: wide enough for a
    # loaded 2-core machine, and well below the getMore's 2.5 s block.
    block = {"failCommands": ["getMore"], "blockConnection": True, "blockTimeMS": 2500}
    with (
        MongoClient(deployment.uri, timeoutMS=1000, serverSelectionTimeoutMS=5000) as client,
        changestream.watch(client[names[0]][names[1]], **FAST) as stream,
    ):
        fail_point(admin, "failCommand", {"times": 1}, **block)
        with pytest.raises(PyMongoError) as info:
            stream.try_next()  # the client's timeoutMS=1000 applies
        assert info.value.timeout and stream.alive
        fail_point(admin, "failCommand", {"times": 1}, **block)
        with pymongo.timeout(10):
            assert stream.try_next() is None  # resumed, then the blocked getMore fits in 10 s


def test_a_dropped_stream_kills_its_cursor_and_returns_its_session(
    client: Any, coll: Any, writer: Any, recorder: Recorder
) -> None:
    import gc

    stream = changestream.watch(coll, batch_size=1, **FAST)
    writer.insert_many([{"i": i} for i in range(3)])
    assert stream.next()["fullDocument"]["i"] == 0
    cursor_id = recorder.replies[0][1]["cursor"]["id"]
    lsid = recorder.commands("aggregate")[0]["lsid"]
    assert cursor_id
    del stream  # never closed
    gc.collect()
    # PyMongo's background task sends the killCursors (about once a second).
    for _ in range(500):
        killed = [c for c in recorder.commands("killCursors") if cursor_id in c["cursors"]]
        if killed:
            break
        threading.Event().wait(0.02)
    assert killed, "the dropped stream's cursor was never killed"
    assert killed[0]["killCursors"] == coll.name
    # The implicit session went back to PyMongo's pool: the next stream reuses it.
    with changestream.watch(coll, **FAST):
        assert recorder.commands("aggregate")[-1]["lsid"] == lsid


def test_take_buffered_gives_the_changes_and_tokens_of_try_next(coll: Any, writer: Any) -> None:
    start = changestream.watch(coll, **FAST)
    start_token = start.resume_token
    start.close()
    writer.insert_many([{"_id": i} for i in range(10)])
    one_by_one = changestream.watch(coll, resume_after=start_token, **FAST)
    expected = []
    while len(expected) < 10:
        change = one_by_one.try_next()
        if change is not None:
            expected.append((change, one_by_one.resume_token))
    one_by_one.close()
    batched = changestream.watch(coll, resume_after=start_token, **FAST)
    taken: list[tuple[Any, Any]] = []
    while not taken:
        first = batched.try_next()
        if first is not None:
            taken = [(first, batched.resume_token)]
    taken += batched.take_buffered(3)
    assert len(taken) == 4, "the 10 inserts came in one batch: 3 taken from its buffer"
    while len(taken) < 10:  # the rest: the buffer (never its last change), then a poll
        more = batched.take_buffered(100)
        change = None if more else batched.try_next()
        taken += more if more else [] if change is None else [(change, batched.resume_token)]
    assert batched.take_buffered(100) == []
    batched.close()
    assert taken == expected
    assert batched.take_buffered(100) == []  # closed
    assert all(type(token) is dict for _, token in taken)


def test_take_buffered_raw_tokens_are_the_servers_bytes_and_resume_there(
        coll: Any, writer: Any) -> None:
    with changestream.watch(coll, **FAST) as start:
        start_token = start.resume_token
    writer.insert_many([{"_id": i} for i in range(6)])
    with changestream.watch(coll, resume_after=start_token, **FAST) as stream:
        first = None
        while first is None:
            first = stream.try_next()
        taken = stream.take_buffered(3, raw_tokens=True)
        assert [c["documentKey"]["_id"] for c, _ in taken] == [1, 2, 3]
        assert all(type(token) is RawBSONDocument for _, token in taken)
        assert bson.encode(taken[-1][1]) == bson.encode(stream.resume_token)
    with changestream.watch(coll, resume_after=taken[0][1], **FAST) as resumed:
        after = None
        while after is None:
            after = resumed.try_next()
        assert after["documentKey"]["_id"] == 2
