"""The change-stream cursor: start positions, postBatchResumeToken, invalidation, images,
resume errors, split events, batching and awaitData waits.

Streams are opened through the ``aggregate`` handler and advanced with the
cursor's own ``get_more`` (what the getMore command calls), over oplog entries
appended with ``Deployment.log``.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
from bson.int64 import Int64
from bson.timestamp import Timestamp
from support import command_context as context

from changestream.testing.changestreams.cursor import SPLIT_THRESHOLD, ChangeStreamCursor
from changestream.testing.changestreams.resume_token import (
    ResumeTokenData,
    decode_token,
    encode_token,
    high_water_mark,
)
from changestream.testing.commands.aggregate import aggregate
from changestream.testing.core.cursors import CursorBatch
from changestream.testing.core.errors import CommandError
from changestream.testing.core.oplog import OplogEntry
from changestream.testing.core.versions import get_profile
from changestream.testing.storage.deployment import Deployment

NOW = 1_700_000_000.0
UUID_A = uuid.UUID("a5093abb-38fe-4b9e-a67f-01bb1a96d812")
UUID_B = uuid.UUID("11111111-2222-4333-8444-555555555555")
WALL = datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc)
MIB = 1024 * 1024



class Stream:
    """A change stream opened with ``aggregate``, continued with ``get_more``."""

    def __init__(
        self,
        d: Deployment,
        *,
        db: str = "db",
        target: str | int = "c",
        pipeline: list[Any] | None = None,
        batch_size: int | None = None,
        command_fields: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        self.d = d
        body: dict[str, Any] = {
            "aggregate": target,
            "pipeline": [{"$changeStream": options}, *(pipeline or [])],
            "cursor": {} if batch_size is None else {"batchSize": batch_size},
            **(command_fields or {}),
        }
        with d.lock:
            self.reply = aggregate(context(d, db, body))["cursor"]
        self.cid = int(self.reply["id"])
        self.cursor: ChangeStreamCursor | None = None
        if self.cid:
            found = d.cursors.checkout(self.cid, d.members[0].name)
            d.cursors.checkin(self.cid)
            assert isinstance(found, ChangeStreamCursor)
            self.cursor = found

    @property
    def first_batch(self) -> list[dict[str, Any]]:
        return list(self.reply["firstBatch"])

    def get_more(self, batch_size: int | None = None, max_time_ms: int = 0) -> CursorBatch:
        assert self.cursor is not None
        ctx = context(self.d, "db", {"getMore": Int64(self.cid)})
        return self.cursor.get_more(ctx, batch_size, max_time_ms)

    def events(self, **kw: Any) -> list[dict[str, Any]]:
        return self.get_more(**kw).documents


def deployment(version: str = "8.0", **kw: Any) -> Deployment:
    return Deployment(get_profile(version), now=lambda: NOW, **kw)


def log(d: Deployment, op: str, ns: str, o: dict[str, Any], **kw: Any) -> OplogEntry:
    with d.lock:
        return d.log(op, ns, o, wall=WALL, **kw)


def insert(
    d: Deployment, _id: Any, ns: str = "db.c", ui: uuid.UUID = UUID_A, **doc: Any
) -> OplogEntry:
    return log(d, "i", ns, {"_id": _id, **doc}, ui=ui, o2={"_id": _id})


def hwm(ts: Timestamp, version: int = 2) -> dict[str, Any]:
    return encode_token(high_water_mark(ts, version))


def error_of(call: Any) -> CommandError:
    with pytest.raises(CommandError) as info:
        call()
    return info.value


# -- start positions and postBatchResumeToken -----------------------------------------------------
def test_new_stream_starts_one_tick_after_the_last_write() -> None:
    d = deployment()
    before = insert(d, 1)
    stream = Stream(d)
    assert stream.first_batch == []
    start = Timestamp(before.ts.time, before.ts.inc + 1)
    assert stream.reply["postBatchResumeToken"] == hwm(start)
    after = insert(d, 2)
    assert after.ts == start
    assert [e["documentKey"] for e in stream.events()] == [{"_id": 2}]


@pytest.mark.parametrize(("version", "token_version"), [("4.2", 1), ("6.0", 1), ("7.0", 2)])
def test_pbrt_advances_past_unrelated_writes_and_no_ops(version: str, token_version: int) -> None:
    d = deployment(version)
    stream = Stream(d)
    first_pbrt = stream.reply["postBatchResumeToken"]
    other = insert(d, 1, ns="db.other", ui=UUID_B)
    batch = stream.get_more()
    assert batch.documents == []
    assert batch.post_batch_resume_token == hwm(other.ts, token_version)
    assert decode_token(first_pbrt).cluster_time == other.ts  # HWM(t) is not greater than HWM(t)
    with d.lock:
        noop = d.log("n", "", {"msg": "periodic noop"})
    assert stream.get_more().post_batch_resume_token == hwm(noop.ts, token_version)


def test_pbrt_is_the_last_event_then_moves_on_at_end_of_batch() -> None:
    d = deployment()
    stream = Stream(d)
    insert(d, 1)
    insert(d, 2)
    batch = stream.get_more(batch_size=1)
    assert batch.post_batch_resume_token == batch.documents[0]["_id"]
    batch = stream.get_more()
    assert batch.post_batch_resume_token == batch.documents[0]["_id"]
    other = insert(d, 3, ns="db.other")
    assert stream.get_more().post_batch_resume_token == hwm(other.ts)


def test_batch_size_zero_returns_an_empty_first_batch_with_a_pbrt() -> None:
    d = deployment()
    insert(d, 1)
    stream = Stream(d, batch_size=0, startAtOperationTime=Timestamp(int(NOW), 1))
    assert stream.first_batch == []
    assert stream.cid != 0
    assert stream.reply["postBatchResumeToken"] == hwm(Timestamp(int(NOW), 1))
    assert [e["documentKey"] for e in stream.events()] == [{"_id": 1}]


def test_start_at_operation_time_is_inclusive() -> None:
    d = deployment()
    insert(d, 1)
    second = insert(d, 2)
    insert(d, 3)
    stream = Stream(d, startAtOperationTime=second.ts)
    assert [e["documentKey"]["_id"] for e in stream.first_batch] == [2, 3]


def test_future_start_at_operation_time_keeps_its_pbrt() -> None:
    d = deployment()
    future = Timestamp(int(NOW) + 100, 1)
    stream = Stream(d, startAtOperationTime=future)
    insert(d, 1)
    batch = stream.get_more()
    assert batch.documents == []
    assert batch.post_batch_resume_token == hwm(future)


def test_resume_after_continues_strictly_after_the_token() -> None:
    d = deployment()
    stream = Stream(d)
    for i in range(3):
        insert(d, i)
    first, second, third = stream.events()
    resumed = Stream(d, resumeAfter=first["_id"])
    assert resumed.reply["postBatchResumeToken"] == third["_id"]
    assert [e["_id"] for e in resumed.first_batch] == [second["_id"], third["_id"]]
    quiet = Stream(d, resumeAfter=third["_id"], batch_size=0)
    assert quiet.reply["postBatchResumeToken"] == third["_id"]  # the client's token itself
    assert quiet.events() == []
    assert quiet.get_more().post_batch_resume_token == third["_id"]


def test_resume_after_a_high_water_mark_includes_events_at_its_time() -> None:
    d = deployment()
    entry = insert(d, 1)
    stream = Stream(d, resumeAfter=hwm(entry.ts))
    assert [e["documentKey"] for e in stream.first_batch] == [{"_id": 1}]


def test_resume_from_an_older_version_token_keeps_its_version_up_to_the_resume_point() -> None:
    d = deployment("8.0")
    v1 = Stream(d, command_fields={"$_generateV2ResumeTokens": False})
    insert(d, 1)
    log(d, "c", "db.$cmd", {"drop": "c"}, ui=UUID_A)
    inserted, dropped, _ = v1.events()
    assert decode_token(dropped["_id"]).version == 1
    # the invalidate sorts after the v1 drop token at the same time: still a v1 token
    (invalidate,) = Stream(d, resumeAfter=dropped["_id"]).first_batch
    assert invalidate["operationType"] == "invalidate"
    assert decode_token(invalidate["_id"]).version == 1
    # events after the resume point get the stream's default version again
    after_insert = Stream(d, resumeAfter=inserted["_id"]).first_batch
    assert [decode_token(e["_id"]).version for e in after_insert] == [2, 2]


def test_event_token_not_found_is_fatal() -> None:
    d = deployment()
    entry = insert(d, 1)
    insert(d, 2)
    missing = ResumeTokenData(
        entry.ts, 2, 128, 0, False, UUID_A, {"operationType": "insert", "documentKey": {"_id": 0}}
    )
    stream_err = error_of(lambda: Stream(d, resumeAfter=encode_token(missing)))
    assert stream_err.code == 280
    assert 'cannot resume stream; the resume token was not found. {_data: "' in stream_err.errmsg
    assert stream_err.errmsg.startswith(
        "Executor error during aggregate command on namespace: db.c :: caused by :: "
    )


def test_a_token_whose_event_is_filtered_out_by_the_users_match_is_still_found() -> None:
    d = deployment()
    stream = Stream(d)
    insert(d, 1)
    insert(d, 2)
    first, second = stream.events()
    resumed = Stream(d, resumeAfter=first["_id"], pipeline=[{"$match": {"documentKey._id": 2}}])
    assert resumed.first_batch == [second]


# -- history lost ------------------------------------------------------------------------------------
def test_resuming_before_the_oldest_oplog_entry_is_history_lost() -> None:
    d = deployment(oplog_max_entries=3)
    stream = Stream(d)
    insert(d, 0)
    (event,) = stream.events()
    for i in range(1, 5):
        insert(d, i)
    err = error_of(lambda: Stream(d, resumeAfter=event["_id"]))
    assert err.code == 286
    assert err.errmsg.endswith(
        "Resume of change stream was not possible, as the resume point may no longer be in the oplog."
    )
    assert error_of(lambda: Stream(d, startAtOperationTime=Timestamp(int(NOW), 1))).code == 286


def test_an_untruncated_oplog_covers_any_earlier_start() -> None:
    d = deployment()
    insert(d, 1)
    stream = Stream(d, startAtOperationTime=Timestamp(1, 1))
    assert [e["documentKey"] for e in stream.first_batch] == [{"_id": 1}]


def test_a_consumer_overtaken_by_oplog_truncation_loses_history() -> None:
    d = deployment(oplog_max_entries=5)
    stream = Stream(d)
    insert(d, 0)
    assert len(stream.events(batch_size=1)) == 1
    for i in range(1, 12):
        insert(d, i)
    err = error_of(stream.get_more)
    assert err.code == 286
    assert err.errmsg.startswith("Executor error during getMore :: caused by :: ")


# -- invalidation -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("version", "flag"), [("6.0", False), ("7.0", True), ("8.2", True)])
def test_invalidate_exhausts_the_cursor_in_the_same_batch(version: str, flag: bool) -> None:
    d = deployment(version)
    stream = Stream(d)
    log(d, "c", "db.$cmd", {"drop": "c"}, ui=UUID_A)
    batch = stream.get_more()
    assert [e["operationType"] for e in batch.documents] == ["drop", "invalidate"]
    assert batch.exhausted
    assert batch.invalidated is flag
    assert batch.post_batch_resume_token == batch.documents[1]["_id"]


def test_invalidate_filtered_by_the_user_still_closes_the_stream() -> None:
    d = deployment()
    stream = Stream(d, pipeline=[{"$match": {"operationType": "insert"}}])
    log(d, "c", "db.$cmd", {"drop": "c"}, ui=UUID_A)
    insert(d, 1)
    batch = stream.get_more()
    assert batch.documents == []
    assert batch.exhausted
    token = decode_token(batch.post_batch_resume_token or {})
    assert token.from_invalidate


def test_a_batch_full_at_the_invalidate_closes_on_the_next_get_more() -> None:
    d = deployment()
    stream = Stream(d)
    log(d, "c", "db.$cmd", {"drop": "c"}, ui=UUID_A)
    assert [e["operationType"] for e in stream.events(batch_size=1)] == ["drop"]
    batch = stream.get_more(batch_size=1)
    assert [e["operationType"] for e in batch.documents] == ["invalidate"]
    assert not batch.exhausted
    closing = stream.get_more()
    assert closing.documents == [] and closing.exhausted
    assert closing.post_batch_resume_token == batch.documents[0]["_id"]


def test_invalidate_in_the_first_batch_returns_cursor_id_zero() -> None:
    d = deployment()
    entry = insert(d, 1)
    log(d, "c", "db.$cmd", {"drop": "c"}, ui=UUID_A)
    stream = Stream(d, startAtOperationTime=entry.ts)
    assert stream.cid == 0
    assert [e["operationType"] for e in stream.first_batch] == ["insert", "drop", "invalidate"]
    assert d.cursors.ids() == []


def test_start_after_an_invalidate_continues_with_the_recreated_collection() -> None:
    d = deployment()
    stream = Stream(d)
    log(d, "c", "db.$cmd", {"drop": "c"}, ui=UUID_A)
    _, invalidate = stream.events()
    insert(d, 1, ui=UUID_B)
    log(d, "c", "db.$cmd", {"drop": "c"}, ui=UUID_B)
    after = Stream(d, startAfter=invalidate["_id"])
    kinds = [e["operationType"] for e in after.first_batch]
    assert kinds == ["insert", "drop", "invalidate"]
    assert after.cid == 0
    err = error_of(lambda: Stream(d, resumeAfter=invalidate["_id"]))
    assert err.code == 260


# -- images --------------------------------------------------------------------------------------------
def update(
    d: Deployment,
    _id: Any,
    pre: dict[str, Any] | None,
    post: dict[str, Any] | None,
    ui: uuid.UUID = UUID_A,
) -> None:
    o = {"$v": 2, "diff": {"u": {"a": 2}}}
    log(d, "u", "db.c", o, ui=ui, o2={"_id": _id}, pre_image=pre, post_image=post)


def test_update_lookup_returns_the_current_document_or_null() -> None:
    d = deployment()
    stream = Stream(d, fullDocument="updateLookup")
    with d.lock:
        state = d.catalog.new_collection("db", "c", {})
        state.insert({"_id": 1, "a": 5})
    update(d, 1, None, None, ui=state.uuid)
    update(d, 2, None, None, ui=state.uuid)
    found, gone = stream.events()
    assert found["fullDocument"] == {"_id": 1, "a": 5}
    assert list(found) == [
        "_id", "operationType", "clusterTime", "wallTime", "fullDocument", "ns", "documentKey",
        "updateDescription",
    ]  # fmt: skip
    assert gone["fullDocument"] is None


def test_update_lookup_follows_the_collection_uuid_across_a_rename() -> None:
    d = deployment()
    stream = Stream(d, fullDocument="updateLookup")
    with d.lock:
        state = d.catalog.new_collection("db", "c", {})
        state.insert({"_id": 1, "a": 7})
    update(d, 1, None, None, ui=state.uuid)
    with d.lock:
        d.catalog.rename(state, "db", "renamed")
    (event,) = stream.events()
    assert event["fullDocument"] == {"_id": 1, "a": 7}


def test_update_lookup_ignores_a_recreated_collection() -> None:
    d = deployment()
    stream = Stream(d, fullDocument="updateLookup")
    with d.lock:
        d.catalog.new_collection("db", "c", {}).insert({"_id": 1})
    update(d, 1, None, None)  # logged with UUID_A, the live collection has another UUID
    (event,) = stream.events()
    assert event["fullDocument"] is None


@pytest.mark.parametrize("mode", ["whenAvailable", "required"])
def test_post_and_pre_images_when_recorded(mode: str) -> None:
    d = deployment("6.0")
    stream = Stream(d, fullDocument=mode, fullDocumentBeforeChange=mode)
    update(d, 1, {"_id": 1, "a": 1}, {"_id": 1, "a": 2})
    (event,) = stream.events()
    assert event["fullDocument"] == {"_id": 1, "a": 2}
    assert event["fullDocumentBeforeChange"] == {"_id": 1, "a": 1}
    assert list(event)[-1] == "fullDocumentBeforeChange"
    assert list(event).index("fullDocument") < list(event).index("ns")


def test_when_available_images_are_null_without_recorded_images() -> None:
    d = deployment()
    stream = Stream(d, fullDocument="whenAvailable", fullDocumentBeforeChange="whenAvailable")
    update(d, 1, None, None)
    log(d, "d", "db.c", {"_id": 1}, ui=UUID_A)
    updated, deleted = stream.events()
    assert updated["fullDocument"] is None and updated["fullDocumentBeforeChange"] is None
    assert deleted["fullDocumentBeforeChange"] is None
    assert "fullDocument" not in deleted


def test_required_images_fail_with_no_matching_document() -> None:
    d = deployment()
    pre = Stream(d, fullDocumentBeforeChange="required")
    post = Stream(d, fullDocument="required")
    entry = log(d, "u", "db.c", {"$v": 2, "diff": {"u": {"a": 2}}}, ui=UUID_A, o2={"_id": 1})
    summary = (
        f'{{operationType: "update", ns: {{db: "db", coll: "c"}}, '
        f"clusterTime: Timestamp({entry.ts.time}, {entry.ts.inc})}}"
    )
    err = error_of(pre.get_more)
    assert (err.code, err.code_name) == (47, "NoMatchingDocument")
    assert err.errmsg == (
        "Executor error during getMore :: caused by :: Change stream was configured to require a "
        "pre-image for all update, delete and replace events, but the pre-image was not found "
        f"for event: {summary}"
    )
    err = error_of(post.get_more)
    assert err.code == 47
    assert err.errmsg.endswith(
        "require a post-image for all update events, but the post-image was not found for "
        f"event: {summary}"
    )


# -- transactions ----------------------------------------------------------------------------------
def test_transaction_batches_and_pbrt() -> None:
    d = deployment()
    stream = Stream(d)
    ts = d.clock.tick()
    ops = [
        OplogEntry(ts=ts, wall=WALL, op="i", ns="db.c", o={"_id": 1}, ui=UUID_A, o2={"_id": 1}),
        OplogEntry(ts=ts, wall=WALL, op="i", ns="db.c", o={"_id": 2}, ui=UUID_A, o2={"_id": 2}),
        OplogEntry(ts=ts, wall=WALL, op="i", ns="db.x", o={"_id": 3}, ui=UUID_B, o2={"_id": 3}),
    ]
    lsid = {"id": uuid.UUID(int=1), "uid": b"\x00" * 32}
    log(d, "c", "admin.$cmd", {"applyOps": []}, lsid=lsid, txn_number=7, txn_ops=ops, ts=ts)
    (first,) = stream.events(batch_size=1)
    batch = stream.get_more()
    (second,) = batch.documents
    assert decode_token(second["_id"]).txn_op_index == 1
    # the transaction's last op is on another collection: the PBRT stays on the event
    assert batch.post_batch_resume_token == second["_id"]
    resumed = Stream(d, resumeAfter=first["_id"])
    assert resumed.first_batch == [second]


# -- size limits and split events -----------------------------------------------------------------------
def test_a_batch_stops_before_16_mib() -> None:
    d = deployment()
    stream = Stream(d)
    for i in range(5):
        insert(d, i, blob="x" * (5 * MIB))
    batch = stream.get_more()
    assert [e["documentKey"]["_id"] for e in batch.documents] == [0, 1, 2]
    assert batch.post_batch_resume_token == batch.documents[-1]["_id"]
    assert [e["documentKey"]["_id"] for e in stream.events()] == [3, 4]


def test_an_oversized_event_without_the_split_stage_fails() -> None:
    d = deployment()
    stream = Stream(d)
    log(
        d,
        "u",
        "db.c",
        {"_id": 1, "a": "x" * (9 * MIB), "b": "y" * (8 * MIB)},
        ui=UUID_A,
        o2={"_id": 1},
    )
    err = error_of(stream.get_more)
    assert (err.code, err.code_name) == (10334, "BSONObjectTooLarge")
    assert (
        "is invalid. Size must be between 0 and 16793600(16MB) First element: _id: { _data: "
        in err.errmsg
    )


def test_large_events_split_into_fragments_and_resume_from_a_fragment() -> None:
    d = deployment("7.0")
    stream = Stream(d, pipeline=[{"$changeStreamSplitLargeEvent": {}}])
    before = {"_id": 1, "big": "a" * (10 * MIB)}
    after = {"_id": 1, "big": "b" * (10 * MIB)}
    log(d, "u", "db.c", {"$v": 2, "diff": {"u": {"big": after["big"]}}}, ui=UUID_A,
        o2={"_id": 1}, pre_image=before, post_image=after)  # fmt: skip
    pre = Stream(d, startAtOperationTime=Timestamp(int(NOW), 1), fullDocumentBeforeChange="required",
                 pipeline=[{"$changeStreamSplitLargeEvent": {}}])  # fmt: skip
    fragments = pre.first_batch
    assert len(fragments) == 1  # two ~10 MiB fragments do not fit in one 16 MiB batch
    fragments += pre.events()
    assert [f["splitEvent"] for f in fragments] == [
        {"fragment": 1, "of": 2},
        {"fragment": 2, "of": 2},
    ]
    assert [list(f)[:2] for f in fragments] == [["_id", "splitEvent"]] * 2
    assert [decode_token(f["_id"]).fragment_num for f in fragments] == [0, 1]
    whole: dict[str, Any] = {}
    for fragment in fragments:
        whole.update({k: v for k, v in fragment.items() if k not in ("_id", "splitEvent")})
    assert whole["fullDocumentBeforeChange"] == before
    assert whole["updateDescription"]["updatedFields"] == {"big": after["big"]}
    # fields go by size: the larger updateDescription fills the second fragment alone
    assert list(fragments[1]) == ["_id", "splitEvent", "updateDescription"]
    assert sorted(whole) == sorted(
        ["operationType", "clusterTime", "wallTime", "ns", "documentKey", "updateDescription",
         "fullDocumentBeforeChange"]
    )  # fmt: skip
    resumed = Stream(d, resumeAfter=fragments[0]["_id"], fullDocumentBeforeChange="required",
                     pipeline=[{"$changeStreamSplitLargeEvent": {}}])  # fmt: skip
    assert resumed.first_batch == [fragments[1]]
    (small,) = stream.events()  # without the pre-image the event is small enough
    assert "splitEvent" not in small
    assert SPLIT_THRESHOLD == 16 * MIB + 8 * 1024


# -- awaitData -------------------------------------------------------------------------------------------
def test_get_more_waits_for_max_time_ms_when_idle() -> None:
    d = deployment()
    stream = Stream(d)
    start = time.monotonic()
    batch = stream.get_more(max_time_ms=300)
    elapsed = time.monotonic() - start
    assert batch.documents == []
    assert 0.25 <= elapsed < 2.0


def test_get_more_wakes_on_a_relevant_write_but_not_an_irrelevant_one() -> None:
    d = deployment()
    stream = Stream(d, pipeline=[{"$match": {"operationType": "insert"}}])

    def writes() -> None:
        time.sleep(0.2)
        insert(d, 1, ns="db.other", ui=UUID_B)  # another collection
        log(d, "d", "db.c", {"_id": 5}, ui=UUID_A)  # filtered by the user's $match
        time.sleep(0.4)
        insert(d, 2)

    writer = threading.Thread(target=writes)
    start = time.monotonic()
    writer.start()
    batch = stream.get_more(max_time_ms=5000)
    elapsed = time.monotonic() - start
    writer.join()
    assert [e["documentKey"] for e in batch.documents] == [{"_id": 2}]
    assert 0.5 <= elapsed < 3.0


def test_killing_a_waiting_cursor_interrupts_its_get_more() -> None:
    d = deployment()
    stream = Stream(d)
    assert stream.cursor is not None
    timer = threading.Timer(0.2, stream.cursor.close)
    timer.start()
    start = time.monotonic()
    err = error_of(lambda: stream.get_more(max_time_ms=5000))
    timer.join()
    assert err.code == 237
    assert time.monotonic() - start < 2.0
