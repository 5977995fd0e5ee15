"""The change stream end to end, written once for both streams: prose, resume and CSOT tests.

Each test hands a scenario to the ``run`` fixture (``tests/conftest.py``): here a
coroutine, run inside ``asyncio.run`` on an asyncio client; in the sync twin a plain
function on a sync client. Both run against the ``changestream.testing``
replica-set simulator (or ``MONGODB_URI``; tests that drive the simulator itself
are then skipped). What only one side does lives in ``test_stream_async_only.py``
and ``test_stream_sync_only.py``.

This asyncio module is the one source of both: ``tools/gen_sync.py`` writes
``tests/stream/test_stream.py`` from it.
"""

from __future__ import annotations

import asyncio  # async-only
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from bson.raw_bson import RawBSONDocument
from pymongo import ReadPreference, monitoring
from pymongo.errors import OperationFailure, PyMongoError
from support import STREAM_COMMANDS, Ctx, interrupt_as_a_getmore_is_chosen, plain

# sync-only: begin
# import changestream
# sync-only: end
from changestream.aio import AsyncChangeStream, watch
from changestream.errors import MissingResumeTokenError

FAST = {"max_await_time_ms": 50}
VOLATILE = {"lsid", "$clusterTime", "$db", "maxTimeMS", "$readPreference"}
BIG = 10 * 1024 * 1024

Run = Callable[..., None]


def address(event: monitoring.CommandStartedEvent) -> str:
    host, port = event.connection_id
    return f"{host}:{port}"


async def drain(stream: AsyncChangeStream[Any], count: int) -> list[Any]:
    return [await stream.next() for _ in range(count)]


# -- helpers and commands ---------------------------------------------------------------------
def test_watch_targets_send_the_spec_commands(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        pipeline = [{"$match": {"operationType": "insert"}}]
        async with await watch(ctx.coll, pipeline, **FAST) as stream:
            ctx.writer.insert_one({"x": 1})
            assert (await stream.next())["fullDocument"]["x"] == 1
        aggregate = ctx.recorder.commands("aggregate")[0]
        assert aggregate["aggregate"] == ctx.coll.name and aggregate["cursor"] == {}
        assert aggregate["pipeline"] == [{"$changeStream": {}}, *pipeline]
        async with await watch(ctx.coll.database, **FAST) as stream:  # sync: with changestream.Client(ctx.client)[ctx.coll.database.name].watch(**FAST) as stream:
            ctx.writer.insert_one({"x": 2})
            assert (await stream.next())["ns"] == {"db": ctx.coll.database.name,
                                                   "coll": ctx.coll.name}
        assert ctx.recorder.commands("aggregate")[-1]["aggregate"] == 1
        assert ctx.recorder.commands("getMore")[-1]["collection"] == "$cmd.aggregate"
        async with await watch(ctx.client, **FAST) as stream:
            ctx.writer.insert_one({"x": 3})
            assert (await stream.next())["fullDocument"]["x"] == 3
        cluster = [e for e in ctx.recorder.events if e.command_name == "aggregate"][-1]
        assert cluster.database_name == "admin"
        assert ctx.recorder.stage() == {"allChangesForCluster": True}

    run(scenario)


def test_iteration_and_one_session_for_every_command(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        stream = await watch(ctx.coll, batch_size=2, **FAST)
        ctx.writer.insert_many([{"i": i} for i in range(5)])
        seen = []
        async for change in stream:
            seen.append(change["fullDocument"]["i"])
            if len(seen) == 5:
                break
        await stream.close()
        assert seen == [0, 1, 2, 3, 4]
        assert not stream.alive
        recorder = ctx.recorder
        assert recorder.commands("aggregate")[0]["cursor"] == {"batchSize": 2}
        assert all(c["batchSize"] == 2 for c in recorder.commands("getMore"))
        assert recorder.names()[-1] == "killCursors"
        assert len({e.command["lsid"]["id"] for e in recorder.events}) == 1
        with pytest.raises(StopAsyncIteration):
            await stream.next()
        assert await stream.try_next() is None

    run(scenario)


# -- prose tests --------------------------------------------------------------------------------
def test_prose_1_tracks_the_last_seen_resume_token(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as stream:
            assert stream.resume_token == ctx.recorder.last_pbrt()
            ctx.writer.insert_many([{"i": 1}, {"i": 2}])
            first = await stream.next()
            if stream._machine.buffered:
                assert stream.resume_token == first["_id"]
                await stream.next()
            assert stream.resume_token == ctx.recorder.last_pbrt()
            assert await stream.try_next() is None
            assert stream.resume_token == ctx.recorder.last_pbrt()

    run(scenario)


def test_prose_2_missing_resume_token_raises_and_closes(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        stream = await watch(ctx.coll, [{"$project": {"_id": 0}}], **FAST)
        ctx.writer.insert_one({"x": 1})
        with pytest.raises((OperationFailure, MissingResumeTokenError)) as info:
            await stream.next()
        if isinstance(info.value, OperationFailure):
            assert info.value.code == 280
        assert not stream.alive

    run(scenario)


def test_prose_3_resumes_once_with_the_initial_pipeline(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        pipeline = [{"$match": {"operationType": "insert"}}]
        async with await watch(ctx.coll, pipeline, full_document="updateLookup",
                               **FAST) as stream:
            ctx.writer.insert_one({"x": 1})
            await stream.next()
            token = stream.resume_token
            ctx.resumable_getmore_failure()
            ctx.writer.insert_one({"x": 2})
            assert (await stream.next())["fullDocument"]["x"] == 2
        first, resumed = (plain(c) for c in ctx.recorder.commands("aggregate"))
        assert resumed["pipeline"][1:] == pipeline
        assert resumed["pipeline"][0] == {
            "$changeStream": {"fullDocument": "updateLookup", "resumeAfter": token}
        }
        assert {k: v for k, v in resumed.items() if k not in VOLATILE | {"pipeline"}} == {
            k: v for k, v in first.items() if k not in VOLATILE | {"pipeline"}
        }
        assert ctx.recorder.names()[-3:] == ["killCursors", "aggregate", "killCursors"]

    run(scenario)


def test_resumes_after_a_network_error(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as stream:
            ctx.writer.insert_one({"x": 1})
            await stream.next()
            token = stream.resume_token
            ctx.fail_point("failCommand", {"times": 1}, failCommands=["getMore"],
                           closeConnection=True)
            ctx.writer.insert_one({"x": 2})
            assert (await stream.next())["fullDocument"]["x"] == 2
        assert ctx.recorder.names().count("aggregate") == 2
        assert plain(ctx.recorder.stage()) == {"resumeAfter": token}

    run(scenario)


@pytest.mark.parametrize("code", [91, 189, 10107])
def test_resumes_on_labelled_not_primary_errors(run: Run, code: int) -> None:
    """PyMongo raises these as NotPrimaryError, whose labels come from the raw reply.

    SDAM marks the primary unknown; with the failpoint its topologyVersion does not
    change, so a short heartbeat lets the resume find it again quickly.
    """

    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as stream:
            ctx.fail_point("failGetMoreAfterCursorCheckout", {"times": 1}, errorCode=code)
            ctx.writer.insert_one({"x": 1})
            assert (await stream.next())["fullDocument"]["x"] == 1
        assert ctx.recorder.names().count("aggregate") == 2

    run(scenario, heartbeatFrequencyMS=500)


def test_prose_4_no_resume_after_an_aggregate_error(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        ctx.fail_point("failCommand", {"times": 1}, failCommands=["aggregate"], errorCode=2)
        with pytest.raises(OperationFailure) as info:
            await watch(ctx.coll, **FAST)
        assert info.value.code == 2
        assert ctx.recorder.names() == ["aggregate"]

    run(scenario)


def test_prose_6_resume_selects_with_the_original_read_preference(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        sim = ctx.deployment.require_sim()
        primary = sim.primary
        async with await watch(ctx.coll, read_preference=ReadPreference.SECONDARY,
                               **FAST) as stream:
            ctx.writer.insert_one({"x": 1})
            await stream.next()
            sim.kill_cursors()
            ctx.writer.insert_one({"x": 2})
            assert (await stream.next())["fullDocument"]["x"] == 2
        addresses: dict[str, list[str]] = {name: [] for name in STREAM_COMMANDS}
        for e in ctx.recorder.events:
            addresses[e.command_name].append(address(e))
        assert len(addresses["aggregate"]) == 2
        assert primary not in addresses["aggregate"] + addresses["getMore"]

    run(scenario)


def test_prose_7_initial_empty_batch_is_not_closed(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as stream:
            reply = ctx.recorder.replies[0][1]["cursor"]
            assert reply["firstBatch"] == [] and reply["id"] != 0
            assert stream.alive
            ctx.writer.insert_one({"x": 1})
            await stream.next()
            assert ctx.recorder.commands("getMore")[0]["getMore"] == reply["id"]

    run(scenario)


def test_prose_8_kill_cursors_error_during_resume_is_suppressed(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as stream:
            ctx.fail_point("failCommand", {"times": 1}, failCommands=["killCursors"],
                           errorCode=2)
            ctx.resumable_getmore_failure()
            ctx.writer.insert_one({"x": 1})
            assert (await stream.next())["fullDocument"]["x"] == 1

    run(scenario)


def test_prose_11_token_is_post_batch_token_for_empty_and_exhausted_batches(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as stream:
            assert await stream.try_next() is None
            assert stream.resume_token == ctx.recorder.last_pbrt()
            ctx.writer.insert_many([{"i": i} for i in range(3)])
            while await stream.try_next() is not None or stream._machine.buffered:
                pass
            assert stream.resume_token == ctx.recorder.last_pbrt()

    run(scenario)


def test_prose_13_mid_batch_token_is_the_previous_id(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as stream:
            ctx.writer.insert_many([{"i": i} for i in range(3, 6)])
            first = await stream.next()
            assert stream._machine.buffered, "the three inserts should arrive in one batch"
            second = await stream.next()
            assert stream.resume_token == second["_id"] != first["_id"]

    run(scenario)


def test_prose_14_uniterated_batch_token(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as stream:
            ctx.writer.insert_many([{"i": i} for i in range(3)])
            first = await stream.next()
        async with await watch(ctx.coll, resume_after=first["_id"], **FAST) as resumed:
            assert resumed._machine.buffered > 0
            assert resumed.resume_token == first["_id"]
        async with await watch(ctx.coll, start_after=first["_id"], **FAST) as started:
            assert started._machine.buffered > 0
            assert started.resume_token == first["_id"]

    run(scenario)


def test_prose_17_start_after_without_results_resumes_with_start_after(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as stream:
            ctx.writer.insert_one({"x": 1})
            token = (await stream.next())["_id"]
        ctx.recorder.clear()
        async with await watch(ctx.coll, start_after=token, **FAST) as stream:
            assert await stream.try_next() is None
            ctx.resumable_getmore_failure()
            await stream.try_next()
        stage = ctx.recorder.stage()
        assert "startAfter" in stage and "resumeAfter" not in stage

    run(scenario)


def test_prose_18_start_after_with_results_resumes_with_resume_after(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as stream:
            ctx.writer.insert_one({"x": 1})
            token = (await stream.next())["_id"]
        ctx.recorder.clear()
        async with await watch(ctx.coll, start_after=token, **FAST) as stream:
            ctx.writer.insert_one({"x": 2})
            await stream.next()
            ctx.resumable_getmore_failure()
            await stream.try_next()
        stage = ctx.recorder.stage()
        assert "resumeAfter" in stage and "startAfter" not in stage

    run(scenario)


def _split_setup(ctx: Ctx) -> Any:
    database = ctx.admin[ctx.coll.database.name]
    database.drop_collection(ctx.coll.name)
    database.create_collection(ctx.coll.name, changeStreamPreAndPostImages={"enabled": True})
    database[ctx.coll.name].insert_one({"_id": 1, "value": "q" * BIG})
    return database[ctx.coll.name]


def test_prose_19_large_events_are_split(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        writer = _split_setup(ctx)
        async with await watch(ctx.coll, [{"$changeStreamSplitLargeEvent": {}}],
                               full_document_before_change="required", **FAST) as stream:
            writer.update_one({}, {"$set": {"value": "z" * BIG}})
            fragments = await drain(stream, 2)
        assert [f["splitEvent"] for f in fragments] == [
            {"fragment": 1, "of": 2},
            {"fragment": 2, "of": 2},
        ]

    run(scenario)


def test_split_reassembly_survives_a_resume_mid_event(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        writer = _split_setup(ctx)
        armed = threading.Event()

        def fail_after_first_fragment(event: monitoring.CommandSucceededEvent) -> None:
            batch = event.reply["cursor"].get("nextBatch") or []
            if event.command_name == "getMore" and batch and not armed.is_set():
                armed.set()
                ctx.resumable_getmore_failure()

        async with await watch(ctx.coll, [{"$changeStreamSplitLargeEvent": {}}], batch_size=1,
                               full_document_before_change="required",
                               reassemble_split_events=True, **FAST) as stream:
            before = stream.resume_token
            ctx.recorder.on_success = fail_after_first_fragment
            writer.update_one({}, {"$set": {"value": "z" * BIG}})
            merged = await stream.next()
            ctx.recorder.on_success = None
            assert armed.is_set()
            assert "splitEvent" not in merged
            assert len(merged["fullDocumentBeforeChange"]["value"]) == BIG
            assert merged["updateDescription"]["updatedFields"]["value"] == "z" * BIG
            assert plain(ctx.recorder.stage()["resumeAfter"]) == before
            assert await stream.try_next() is None

    run(scenario)


# -- CSOT -------------------------------------------------------------------------------------
def test_timeout_keeps_the_stream_and_the_next_call_resumes(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, timeout_ms=300, max_await_time_ms=50) as stream:
            ctx.fail_point("failCommand", {"times": 1}, failCommands=["getMore"],
                           blockConnection=True, blockTimeMS=500)
            with pytest.raises(PyMongoError) as info:
                await stream.next()
            assert info.value.timeout
            assert stream.alive
            ctx.writer.insert_one({"x": 1})
            assert (await stream.next())["fullDocument"]["x"] == 1
        names = [n for n in ctx.recorder.names() if n != "killCursors"]
        assert names[:3] == ["aggregate", "getMore", "aggregate"]
        assert "maxTimeMS" in ctx.recorder.commands("aggregate")[0]
        assert all(c["maxTimeMS"] <= 50 for c in ctx.recorder.commands("getMore"))

    run(scenario)


def test_getmore_has_no_max_time_without_max_await(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, timeout_ms=3000) as stream:
            assert await stream.try_next() is None
        assert "maxTimeMS" in ctx.recorder.commands("aggregate")[0]
        assert "maxTimeMS" not in ctx.recorder.commands("getMore")[0]

    run(scenario)


def test_pymongo_timeout_block_replaces_the_client_timeout(run: Run) -> None:
    import pymongo

    # The client's timeoutMS (1 s) also bounds opening the stream: wide enough for a
    # loaded 2-core machine, and well below the getMore's 2.5 s block.
    async def scenario(ctx: Ctx) -> None:
        block = {"failCommands": ["getMore"], "blockConnection": True, "blockTimeMS": 2500}
        async with await watch(ctx.coll, **FAST) as stream:
            ctx.fail_point("failCommand", {"times": 1}, **block)
            with pytest.raises(PyMongoError) as info:
                await stream.try_next()  # the client's timeoutMS=1000 applies
            assert info.value.timeout and stream.alive
            ctx.fail_point("failCommand", {"times": 1}, **block)
            with pymongo.timeout(10):
                assert await stream.try_next() is None  # resumed, then the getMore fits in 10 s

    run(scenario, timeoutMS=1000)


# -- end of stream, documents and tokens -------------------------------------------------------------
def test_invalidate_closes_and_its_token_starts_a_new_stream(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        stream = await watch(ctx.coll, **FAST)
        ctx.writer.drop()
        events = [event async for event in stream]
        assert [e["operationType"] for e in events] == ["drop", "invalidate"]
        assert not stream.alive
        assert stream.resume_token == events[-1]["_id"]
        ctx.writer.insert_one({"x": 1})
        async with await watch(ctx.coll, start_after=stream.resume_token, **FAST) as again:
            assert (await again.next())["operationType"] == "insert"

    run(scenario)


def test_resume_after_the_server_lost_the_cursor(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        sim = ctx.deployment.require_sim()
        async with await watch(ctx.coll, **FAST) as stream:
            assert await stream.try_next() is None
            sim.kill_cursors()
            ctx.writer.insert_one({"x": 1})
            assert (await stream.next())["fullDocument"]["x"] == 1
        assert ctx.recorder.names().count("aggregate") == 2

    run(scenario)


def test_failover_resumes_on_the_new_primary(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        sim = ctx.deployment.require_sim()
        async with await watch(ctx.coll, **FAST) as stream:
            ctx.writer.insert_one({"x": 1})
            await stream.next()
            new_primary = sim.step_down()
            ctx.writer.insert_one({"x": 2})
            assert (await stream.next())["fullDocument"]["x"] == 2
        resume = [e for e in ctx.recorder.events if e.command_name == "aggregate"][-1]
        assert address(resume) == new_primary

    run(scenario)


def test_typed_events_and_raw_documents(run: Run) -> None:
    from changestream import events

    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, typed=True, **FAST) as typed:
            ctx.writer.insert_one({"x": 1})
            assert isinstance(await typed.next(), events.InsertEvent)
        async with await watch(ctx.coll, document_class=RawBSONDocument, **FAST) as raw:
            ctx.writer.insert_one({"x": 2})
            assert isinstance(await raw.next(), RawBSONDocument)
            token = raw.resume_token
            assert isinstance(token, RawBSONDocument)
            ctx.writer.insert_one({"x": 3})
        async with await watch(ctx.coll, resume_after=token, **FAST) as resumed:
            assert (await resumed.next())["fullDocument"]["x"] == 3

    run(scenario)


def test_collation_and_comment_are_sent(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, collation={"locale": "en"}, comment="hi",
                               **FAST) as stream:
            await stream.try_next()
        aggregate = ctx.recorder.commands("aggregate")[0]
        assert aggregate["collation"] == {"locale": "en"} and aggregate["comment"] == "hi"
        assert ctx.recorder.commands("getMore")[0]["comment"] == "hi"

    run(scenario)


# -- position -------------------------------------------------------------------------------------
def test_position_lag_and_resumes_through_a_resume(run: Run) -> None:
    """The stream shows its position, lag and resume count (worked out by the machine)."""

    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, max_await_time_ms=50) as stream:
            ctx.writer.insert_many([{"i": i} for i in range(3)])
            ctx.fail_point("failCommand", {"times": 1}, failCommands=["getMore"],
                           closeConnection=True)
            seen = []
            for _ in range(200):
                change = await stream.try_next()
                if change is not None:
                    seen.append(change)
                if len(seen) == 3:
                    break
            assert len(seen) == 3 and stream.resumes == 1
            token_time = stream.position.token_time
            assert token_time is not None and token_time >= seen[-1]["clusterTime"]
            assert stream.lag is not None and stream.lag <= timedelta(seconds=5)

    run(scenario)


# -- closing and interruption ---------------------------------------------------------------------
def test_an_interrupt_just_after_a_getmore_was_chosen_still_closes_the_stream(
        run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C lands between the machine choosing a getMore and the shell sending it (a
    signal is handled between any two bytecodes): that getMore must not stay "in flight",
    else close() refuses with a RuntimeError and the cursor is never killed."""
    async def scenario(ctx: Ctx) -> None:
        stream = await watch(ctx.coll, **FAST)
        assert await stream.try_next() is None
        token = stream.resume_token
        cursor_id = stream._machine.cursor_id
        interrupt_as_a_getmore_is_chosen(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            await stream.next()
        monkeypatch.undo()
        await stream.close()  # raised RuntimeError: the getMore was still in flight
        assert not stream.alive and stream.resume_token == token
        kills = ctx.recorder.commands("killCursors")
        assert [k["cursors"] for k in kills] == [[cursor_id]]

    run(scenario)


# -- dropped streams, batches taken at once ---------------------------------------------------------
def test_a_dropped_stream_kills_its_cursor_and_returns_its_session(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        import gc

        stream = await watch(ctx.coll, batch_size=1, **FAST)
        ctx.writer.insert_many([{"i": i} for i in range(3)])
        assert (await stream.next())["fullDocument"]["i"] == 0
        cursor_id = ctx.recorder.replies[0][1]["cursor"]["id"]
        lsid = ctx.recorder.commands("aggregate")[0]["lsid"]
        assert cursor_id
        del stream  # never closed
        gc.collect()
        # AsyncMongoClient's background task sends the killCursors (about once a second).
        killed: list[Any] = []
        for _ in range(500):
            killed = [c for c in ctx.recorder.commands("killCursors")
                      if cursor_id in c["cursors"]]
            if killed:
                break
            await asyncio.sleep(0.02)  # sync: threading.Event().wait(0.02)
        assert killed, "the dropped stream's cursor was never killed"
        assert killed[0]["killCursors"] == ctx.coll.name
        # The implicit session went back to PyMongo's pool: the next stream reuses it.
        async with await watch(ctx.coll, **FAST):
            assert ctx.recorder.commands("aggregate")[-1]["lsid"] == lsid

    run(scenario)


def test_take_buffered_gives_the_changes_and_tokens_of_try_next(run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, **FAST) as start:
            start_token = start.resume_token
        ctx.writer.insert_many([{"_id": i} for i in range(10)])
        expected = []
        async with await watch(ctx.coll, resume_after=start_token, **FAST) as one_by_one:
            while len(expected) < 10:
                change = await one_by_one.try_next()
                if change is not None:
                    expected.append((change, one_by_one.resume_token))
        batched = await watch(ctx.coll, resume_after=start_token, **FAST)
        taken: list[tuple[Any, Any]] = []
        while not taken:
            first = await batched.try_next()
            if first is not None:
                taken = [(first, batched.resume_token)]
        # async-only: begin
        async with batched._lock:  # another call under way: nothing taken
            assert batched.take_buffered(3) == []
        # async-only: end
        taken += batched.take_buffered(3)
        assert len(taken) == 4, "the 10 inserts came in one batch: 3 taken from its buffer"
        while len(taken) < 10:  # the rest: the buffer (never its last change), then a poll
            more = batched.take_buffered(100)
            change = None if more else await batched.try_next()
            taken += more if more else [] if change is None else [(change, batched.resume_token)]
        assert batched.take_buffered(100) == []
        await batched.close()
        assert taken == expected
        assert batched.take_buffered(100) == []  # closed
        assert all(type(token) is dict for _, token in taken)

    run(scenario)


# -- reading ahead (consume's streams; changestream._read_ahead) ------------------------------
async def _changes_and_tokens(stream: AsyncChangeStream[Any], count: int) -> list[Any]:
    """(the ``i`` of each change, the resume token after it) for ``count`` changes."""
    seen = []
    while len(seen) < count:
        change = await stream.try_next()
        if change is not None:
            seen.append((change["fullDocument"]["i"], plain(stream.resume_token)))
    return seen


def test_read_ahead_hands_out_the_same_changes_and_tokens_and_asks_before_the_caller(
        run: Run) -> None:
    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, batch_size=4, **FAST) as plain_stream:
            start = plain_stream.resume_token
            ctx.writer.insert_many([{"i": i} for i in range(30)])
            expected = await _changes_and_tokens(plain_stream, 30)
        async with await watch(ctx.coll, batch_size=4, resume_after=start, **FAST) as stream:
            stream.read_ahead()
            first = await stream.next()  # the aggregate's first batch: nothing read ahead yet
            while stream.buffered:
                await stream.next()
            getmores = ctx.recorder.names().count("getMore")
            await stream.next()  # one getMore, for a batch of 4: the next goes out at once
            for _ in range(200):  # beside the caller, who asks for nothing meanwhile
                if ctx.recorder.names().count("getMore") > getmores + 1:
                    break
                await asyncio.sleep(0.01)  # sync: threading.Event().wait(0.01)
            assert ctx.recorder.names().count("getMore") == getmores + 2, ctx.recorder.names()
            assert stream.buffered == 3
        async with await watch(ctx.coll, batch_size=4, resume_after=start, **FAST) as stream:
            stream.read_ahead()
            assert await _changes_and_tokens(stream, 30) == expected
        assert first["fullDocument"]["i"] == 0

    run(scenario)


def test_read_ahead_resumes_after_a_getmore_read_ahead_fails(run: Run) -> None:
    """The failure reaches the stream when it asks, as if the getMore had just run: it resumes
    from the last change handed out, and no change is lost or handed out twice."""

    async def scenario(ctx: Ctx) -> None:
        async with await watch(ctx.coll, batch_size=3, **FAST) as stream:
            start = stream.resume_token
            ctx.writer.insert_many([{"i": i} for i in range(12)])
        async with await watch(ctx.coll, batch_size=3, resume_after=start, **FAST) as stream:
            stream.read_ahead()
            seen = [(await stream.next())["fullDocument"]["i"] for _ in range(5)]
            ctx.resumable_getmore_failure()  # the getMore read ahead (or the next) fails
            seen += [(await stream.next())["fullDocument"]["i"] for _ in range(7)]
        assert seen == list(range(12))
        assert ctx.recorder.names().count("aggregate") == 3  # the two opens and one resume

    run(scenario)


def test_read_ahead_close_ends_the_getmore_sent_ahead_and_kills_the_cursor(run: Run) -> None:
    """The getMore sent ahead waits on the server (an idle stream, a 10 s await): the close
    kills its cursor aside instead of waiting it out."""

    async def scenario(ctx: Ctx) -> None:
        stream = await watch(ctx.coll, batch_size=2, max_await_time_ms=10_000)
        stream.read_ahead()
        ctx.writer.insert_many([{"i": i} for i in range(6)])
        assert [(await stream.next())["fullDocument"]["i"] for _ in range(6)] == list(range(6))
        await asyncio.sleep(0.3)  # sync: threading.Event().wait(0.3)
        started = time.monotonic()
        await stream.close()
        assert time.monotonic() - started < 5, "the close waited out the getMore's await"
        assert not stream.alive and ctx.recorder.names()[-1] == "killCursors"
        assert await stream.try_next() is None
        assert not [thread for thread in threading.enumerate()
                    if thread.name == "changestream-read-ahead"]

    run(scenario)
