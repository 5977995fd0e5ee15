"""The change-stream serving fast paths send exactly the bytes the general paths would.

* the resume-token template path equals the general KeyString encoder on
  thousands of random ``_id`` values, types, versions and transaction indexes;
* an :class:`EncodedEvent` is its dict: replies copy its bytes, which decode to
  the dict, field order included (``_id`` is not moved first);
* events taken from the cache equal freshly built ones, byte for byte, for
  every stream shape (options, user stages, images, scopes, versions), and a
  second stream over the same range does not run the transform again;
* ``updateLookup`` reads the current document on every read; a stream resumed
  from a token of another version does not leak its tokens to other streams;
* the cache's bound and its keep-the-newest policy;
* over the wire, repeated reads of one range return byte-identical batches.
"""

from __future__ import annotations

import copy
import gc
import random
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import bson
import pymongo
import pytest
from bson.codec_options import CodecOptions
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp
from support import command_context as _ctx

from changestream.testing import ReplicaSet
from changestream.testing.changestreams import resume_token
from changestream.testing.changestreams.event_cache import EncodedEvent, encode_event
from changestream.testing.changestreams.resume_token import (
    decode_token,
    encode_event_token,
    encode_token,
    event_token,
)
from changestream.testing.changestreams.transform import EventTransformer
from changestream.testing.commands import REGISTRY
from changestream.testing.core.codec import ENCODE_OPTIONS
from changestream.testing.core.cursors import CursorBatch
from changestream.testing.core.errors import CommandError
from changestream.testing.core.event_cache import EventCache
from changestream.testing.core.oplog import OplogEntry
from changestream.testing.core.versions import get_profile
from changestream.testing.storage.deployment import Deployment

NOW = 1_700_000_000.0
UUID_A = uuid.UUID("a5093abb-38fe-4b9e-a67f-01bb1a96d812")
WALL = datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc)
OP_TYPES = ("insert", "update", "replace", "delete", "drop", "createIndexes", "modify")


# -- resume tokens -------------------------------------------------------------------------------
def _random_id(rng: random.Random) -> Any:
    kind = rng.randrange(10)
    if kind < 3:
        return ObjectId(rng.randbytes(12))
    if kind < 5:
        alphabet = "aZ09 _-.é漢字😀\u0101\x7f"
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
    if kind == 5:
        return rng.choice(["", "\x00", "a\x00b", "\x00\x00"])  # NULs: the general path
    if kind < 8:
        edges = [0, 1, -1, 2**30 - 1, 2**30, -(2**30), 2**31 - 1, -(2**31), 2**31, -(2**31) - 1]
        return rng.choice(edges + [rng.randrange(-(2**40), 2**40) for _ in range(5)])
    return rng.choice(
        [1.5, -0.0, Int64(rng.randrange(-(2**50), 2**50)), True, None, {"a": 1}, [1, "x"],
         b"\x01\x02", uuid.UUID(int=rng.getrandbits(128))]
    )  # fmt: skip


def _encodings(*parts: Any) -> tuple[Any, Any]:
    """(fast, general) encoding of an event token, or the error codes they raise."""
    results: list[Any] = []
    for encode in (encode_event_token, lambda *p: encode_token(event_token(*p))):
        try:
            results.append(encode(*parts))
        except CommandError as err:
            results.append(("error", err.code))
    return results[0], results[1]


def test_fast_token_encoder_equals_the_general_encoder_on_random_events() -> None:
    rng = random.Random(20240607)
    fast_shapes = 0
    for _ in range(6000):
        ident = _random_id(rng)
        document_key: dict[str, Any] = {"_id": ident}
        if rng.random() < 0.05:
            document_key = {"sk": rng.randrange(5), "_id": ident}  # a shard key: general path
        parts = (
            Timestamp(rng.randrange(2**32), rng.randrange(2**32)),
            rng.choice((0, 1, 2, 2, 2)),
            rng.choice((0, 0, 0, 1, 7, 2**30 - 1, 2**30)),
            rng.choice((UUID_A, UUID_A, None)),
            rng.choice(OP_TYPES),
            document_key,
            None,
        )
        fast, general = _encodings(*parts)
        assert fast == general, parts
        fast_shapes += type(ident) in (ObjectId, str, int)
    assert fast_shapes > 3000


def test_the_template_path_is_taken_for_plain_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    ts = Timestamp(1_700_000_000, 3)
    samples = [ObjectId(), "k", 5, -(2**31)]
    expected = [encode_event_token(ts, 2, 0, UUID_A, "insert", {"_id": v}, None) for v in samples]

    def fail(data: Any) -> dict[str, Any]:
        raise AssertionError("the general encoder ran")

    monkeypatch.setattr(resume_token, "encode_token", fail)
    assert [
        encode_event_token(ts, 2, 0, UUID_A, "insert", {"_id": v}, None) for v in samples
    ] == expected
    with pytest.raises(AssertionError, match="general encoder"):
        encode_event_token(ts, 2, 0, UUID_A, "insert", {"_id": 2**31}, None)  # an int64


def test_fast_tokens_decode_to_their_parts() -> None:
    oid = ObjectId()
    token = encode_event_token(Timestamp(7, 9), 2, 3, UUID_A, "delete", {"_id": oid}, None)
    assert decode_token(token) == event_token(
        Timestamp(7, 9), 2, 3, UUID_A, "delete", {"_id": oid}, None
    )


# -- encoded events ----------------------------------------------------------------------------------
def test_an_encoded_event_is_its_dict_and_replies_copy_its_bytes() -> None:
    doc = {"to": {"db": "d", "coll": "b"}, "_id": {"_data": "82"}, "n": Int64(1), "u": UUID_A}
    event = encode_event(doc)
    assert event == doc and list(event) == list(doc)
    decoded: dict[str, Any] = bson.decode(event.raw, CodecOptions(uuid_representation=4))
    assert list(decoded) == ["to", "_id", "n", "u"]  # _id stays where it is, as in a batch
    assert bson.encode({"b": [event]}, codec_options=ENCODE_OPTIONS) == bson.encode(
        {"b": [doc]}, codec_options=ENCODE_OPTIONS
    )
    forged = EncodedEvent(doc)
    forged.raw = bson.encode({"other": 1})
    assert bson.decode(bson.encode({"b": [forged]}))["b"] == [{"other": 1}]  # raw is what is sent
    for duplicate in (copy.copy(event), copy.deepcopy(event), event.copy()):
        assert type(duplicate) is dict and duplicate == doc  # a copy may change: encoded again


# -- the cache, through the cursor -----------------------------------------------------------------

def _run(d: Deployment, db: str, body: dict[str, Any]) -> dict[str, Any]:
    with d.lock:
        return REGISTRY[next(iter(body))].handler(_ctx(d, db, body))


def _plain(value: Any) -> Any:
    """``value`` with every dict (EncodedEvent too) rebuilt as a plain dict."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _batch_bytes(batch: CursorBatch) -> bytes:
    """What a reply carries of ``batch``; checks the events' bytes match their dicts."""
    body = {"b": batch.documents, "pbrt": batch.post_batch_resume_token}
    sent = bson.encode(body, codec_options=ENCODE_OPTIONS)
    assert sent == bson.encode(_plain(body), codec_options=ENCODE_OPTIONS)
    return sent


def _read(
    d: Deployment, start: Timestamp, shape: dict[str, Any], batch_size: int = 7
) -> list[bytes]:
    """Every batch of a stream opened at ``start`` until it is exhausted or drained."""
    db, target = ("db", 1) if shape.get("database") else ("db", "c")
    options = {"startAtOperationTime": start, **shape.get("options", {})}
    body: dict[str, Any] = {
        "aggregate": target,
        "pipeline": [{"$changeStream": options}, *shape.get("pipeline", [])],
        "cursor": {"batchSize": batch_size},
    }
    reply = _run(d, db, body)["cursor"]
    batches = [_batch_bytes(CursorBatch(reply["firstBatch"], False, reply["postBatchResumeToken"]))]
    cid = int(reply["id"])
    while cid:
        cursor = d.cursors.checkout(cid, d.members[0].name)
        batch = cursor.get_more(_ctx(d, db, {"getMore": Int64(cid)}), batch_size, 0)
        d.cursors.checkin(cid, drop=batch.exhausted)
        batches.append(_batch_bytes(batch))
        if batch.exhausted:
            break
        if not batch.documents:
            d.cursors.kill(cid, d.members[0].name)
            break
    return batches


def _workload(version: str) -> tuple[Deployment, Timestamp]:
    """Every kind of event: CRUD on several _id types, images, a transaction, DDL, a drop."""
    d = Deployment(get_profile(version), now=lambda: NOW)
    _run(d, "db", {"create": "c"})
    if get_profile(version).pre_post_images:
        _run(d, "db", {"collMod": "c", "changeStreamPreAndPostImages": {"enabled": True}})
    start = d.last_applied()
    ids: list[Any] = [ObjectId(), "s1", 3, 2**40, 4.5, {"k": 1}, "x\x00y"]
    _run(d, "db", {"insert": "c", "documents": [{"_id": i, "a": n} for n, i in enumerate(ids)]})
    _run(d, "db", {"insert": "other", "documents": [{"_id": 1}]})
    _run(d, "db", {"update": "c", "updates": [{"q": {"_id": "s1"}, "u": {"$set": {"a": 9}}}]})
    _run(d, "db", {"update": "c", "updates": [{"q": {"_id": 3}, "u": {"b": 1}}]})
    _run(d, "db", {"delete": "c", "deletes": [{"q": {"_id": 4.5}, "limit": 1}]})
    _run(d, "db", {"createIndexes": "c", "indexes": [{"key": {"a": 1}, "name": "a_1"}]})
    _transaction(d, [100, 101])
    _run(d, "admin", {"renameCollection": "db.other", "to": "db.renamed"})
    _run(d, "db", {"insert": "c", "documents": [{"_id": ObjectId(), "late": True}]})
    _run(d, "db", {"drop": "c"})
    return d, start


def _transaction(d: Deployment, ids: list[int]) -> None:
    """A committed transaction inserting ``ids`` into ``db.c`` (one applyOps entry)."""
    with d.lock:
        state = d.catalog.get("db", "c")
        assert state is not None
        ts = d.clock.tick()
        ops = [
            OplogEntry(ts=ts, wall=WALL, op="i", ns="db.c", o={"_id": i}, ui=state.uuid, o2={"_id": i})
            for i in ids
        ]  # fmt: skip
        lsid = {"id": uuid.UUID(int=1), "uid": b"\x00" * 32}
        d.log("c", "admin.$cmd", {"applyOps": []}, lsid=lsid, txn_number=7, txn_ops=ops, ts=ts)


SHAPES: list[dict[str, Any]] = [
    {},
    {"options": {"fullDocument": "updateLookup"}},
    {"options": {"showExpandedEvents": True}},
    {"pipeline": [{"$match": {"operationType": {"$in": ["insert", "update"]}}}]},
    {"pipeline": [{"$project": {"_id": 1, "operationType": 1}}]},
    {"pipeline": [{"$addFields": {"copy": "$$ROOT"}}]},
    {"database": True, "options": {"showExpandedEvents": True}},
    {"database": True},
]
IMAGE_SHAPE = {
    "options": {"fullDocument": "whenAvailable", "fullDocumentBeforeChange": "whenAvailable"}
}


@pytest.mark.parametrize("version", ["4.2", "6.0", "8.0"])
def test_cached_events_equal_freshly_built_events_for_every_shape(version: str) -> None:
    d, start = _workload(version)
    cache = d.event_cache
    profile = get_profile(version)
    shapes = [s for s in SHAPES if profile.expanded_events or "showExpandedEvents" not in str(s)]
    shapes += [IMAGE_SHAPE] if profile.pre_post_images else []
    fresh = []
    for shape in shapes:
        cache.clear()
        fresh.append(_read(d, start, shape))
    cache.clear()
    for _ in range(2):  # the second round takes everything from the cache
        for shape, expected in zip(shapes, fresh, strict=True):
            assert _read(d, start, shape) == expected, shape
    assert len(cache) > 0


def test_a_second_stream_of_the_same_shape_does_not_run_the_transform(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, start = _workload("8.0")
    calls: list[OplogEntry] = []
    original = EventTransformer.events

    def counted(self: EventTransformer, entry: OplogEntry) -> Any:
        calls.append(entry)
        return original(self, entry)

    monkeypatch.setattr(EventTransformer, "events", counted)
    first = _read(d, start, {"pipeline": [{"$project": {"_id": 1, "operationType": 1}}]})
    assert len(calls) > 10
    calls.clear()
    plain = _read(d, start, {})  # same events, other user stages: the events are shared
    again = _read(d, start, {})
    assert calls == []
    assert plain == again and plain != first


def _documents(batches: list[bytes]) -> list[dict[str, Any]]:
    return [doc for raw in batches for doc in bson.decode(raw)["b"]]


def test_update_lookup_reads_the_current_document_on_every_read() -> None:
    d = Deployment(get_profile("8.0"), now=lambda: NOW)
    _run(d, "db", {"insert": "c", "documents": [{"_id": 1, "a": 1}]})
    inserted = d.last_applied()
    start = Timestamp(inserted.time, inserted.inc + 1)
    _run(d, "db", {"update": "c", "updates": [{"q": {"_id": 1}, "u": {"$set": {"a": 2}}}]})
    shape = {"options": {"fullDocument": "updateLookup"}}
    (first,) = _documents(_read(d, start, shape))
    assert first["fullDocument"] == {"_id": 1, "a": 2}
    _run(d, "db", {"update": "c", "updates": [{"q": {"_id": 1}, "u": {"$set": {"a": 3}}}]})
    again, later = _documents(_read(d, start, shape))
    assert again["_id"] == first["_id"]
    assert again["fullDocument"] == later["fullDocument"] == {"_id": 1, "a": 3}
    _run(d, "db", {"delete": "c", "deletes": [{"q": {"_id": 1}, "limit": 1}]})
    gone = _documents(_read(d, start, shape))[0]
    assert gone["fullDocument"] is None


def test_a_stream_resumed_from_a_token_of_another_version_does_not_share_its_events() -> None:
    d = Deployment(get_profile("8.0"), now=lambda: NOW)
    _run(d, "db", {"create": "c"})
    start = d.last_applied()
    _transaction(d, [100, 101, 102])
    _run(d, "db", {"insert": "c", "documents": [{"_id": 9}]})
    fresh = _read(d, start, {})
    v1_body = {
        "aggregate": "c",
        "pipeline": [{"$changeStream": {"startAtOperationTime": start}}],
        "cursor": {},
        "$_generateV2ResumeTokens": False,
    }
    last_op = _run(d, "db", v1_body)["cursor"]["firstBatch"][2]["_id"]
    assert (decode_token(last_op).version, decode_token(last_op).txn_op_index) == (1, 2)
    d.event_cache.clear()
    resume = {
        "aggregate": "c",
        "pipeline": [{"$changeStream": {"resumeAfter": last_op}}],
        "cursor": {},
    }
    (after,) = _run(d, "db", resume)["cursor"]["firstBatch"]
    assert decode_token(after["_id"]).version == 2
    # the resumed stream built the transaction's events with v1 tokens: they stayed its own
    assert _read(d, start, {}) == fresh


def test_large_events_split_the_same_way_from_the_cache() -> None:
    d = Deployment(get_profile("7.0"), now=lambda: NOW)
    _run(d, "db", {"create": "c"})
    _run(d, "db", {"collMod": "c", "changeStreamPreAndPostImages": {"enabled": True}})
    _run(d, "db", {"insert": "c", "documents": [{"_id": 1, "big": "a" * (9 * 1024 * 1024)}]})
    inserted = d.last_applied()
    start = Timestamp(inserted.time, inserted.inc + 1)
    big = {"q": {"_id": 1}, "u": {"$set": {"big": "b" * (9 * 1024 * 1024)}}}
    _run(d, "db", {"update": "c", "updates": [big]})
    shape = {
        "options": {"fullDocumentBeforeChange": "required"},
        "pipeline": [{"$changeStreamSplitLargeEvent": {}}],
    }
    first = _read(d, start, shape, batch_size=10)
    assert [f["splitEvent"] for f in _documents(first)] == [
        {"fragment": 1, "of": 2},
        {"fragment": 2, "of": 2},
    ]
    assert _read(d, start, shape, batch_size=10) == first


# -- the cache's bound --------------------------------------------------------------------------------
def test_the_cache_keeps_the_newest_entries_within_its_bound() -> None:
    cache = EventCache(max_bytes=10_000)
    events = [object()]
    for seq in range(100):
        cache.put(seq, "s", events, 1000)
    assert cache.size <= 10_000
    held = [seq for seq in range(100) if cache.get(seq, "s") is not None]
    assert held == list(range(100 - len(held), 100)) and len(held) >= 3
    cache.put(5, "s", events, 1000)  # older than everything held: not admitted
    assert cache.get(5, "s") is None
    cache.put(100, "t", [], 0)  # newer: admitted, the oldest goes if needed
    assert cache.get(100, "t") == [] and cache.size <= 10_000
    assert cache.get(99, "s") is events and cache.get(99, "t") is None
    cache.clear()
    assert len(cache) == 0 and cache.size == 0
    cache.put(1, "s", events, 1000)
    assert cache.get(1, "s") is events  # room again: older entries are welcome
    cache.put(2, "s", events, 50_000)  # larger than the whole cache
    assert cache.get(2, "s") is None and cache.size <= 10_000


# -- over the wire ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0", noop_interval=0) as replset:
        yield replset


def test_repeated_reads_over_the_wire_are_byte_identical(rs: ReplicaSet) -> None:
    raw_options: CodecOptions[RawBSONDocument] = CodecOptions(document_class=RawBSONDocument)
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    with client, client.start_session() as session:
        db = client["fast"]
        db["marker"].insert_one({}, session=session)
        start = session.operation_time
        ids: list[Any] = [ObjectId() for _ in range(200)] + ["a", 7, 2**33, 1.25, {"x": "y"}]
        db["c"].insert_many([{"_id": i, "n": n, "s": "abc"} for n, i in enumerate(ids)])
        db["c"].update_many({}, {"$inc": {"n": 1}})

        def read() -> list[bytes]:
            """Each batch's events and postBatchResumeToken, as the server sent them."""
            command: dict[str, Any] = {
                "aggregate": "c",
                "pipeline": [{"$changeStream": {"startAtOperationTime": start}}],
                "cursor": {"batchSize": 50},
            }
            cursor = db.command(command, codec_options=raw_options)["cursor"]
            batches = [
                bson.encode({"b": cursor["firstBatch"], "t": cursor["postBatchResumeToken"]})
            ]
            got, cid = len(cursor["firstBatch"]), cursor["id"]
            while got < 2 * len(ids):
                command = {"getMore": cid, "collection": "c", "batchSize": 50}
                cursor = db.command(command, codec_options=raw_options)["cursor"]
                batches.append(
                    bson.encode({"b": cursor["nextBatch"], "t": cursor["postBatchResumeToken"]})
                )
                got += len(cursor["nextBatch"])
            db.command({"killCursors": "c", "cursors": [cid]})
            return batches

        cache = rs.deployment.event_cache
        cache.clear()
        first = read()
        assert len(cache) > 0
        assert read() == first
        cache.clear()
        assert read() == first


def test_the_event_cache_bound_is_configurable() -> None:
    from changestream.testing import ReplicaSet
    from changestream.testing.core.event_cache import CACHE_BYTES

    assert ReplicaSet("8.0").deployment.event_cache.max_bytes == CACHE_BYTES
    small = ReplicaSet("8.0", event_cache_bytes=1024)
    assert small.deployment.event_cache.max_bytes == 1024
    with pytest.raises(ValueError, match="event_cache_bytes"):
        ReplicaSet("8.0", event_cache_bytes=-1)


# -- sharing between scopes, and the cache's life -------------------------------------------------------
def test_collection_database_and_cluster_streams_share_each_crud_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, start = _workload("8.0")
    built: list[OplogEntry] = []
    original = EventTransformer.events

    def counted(self: EventTransformer, entry: OplogEntry) -> Any:
        built.append(entry)
        return original(self, entry)

    monkeypatch.setattr(EventTransformer, "events", counted)
    d.event_cache.clear()
    collection = _read(d, start, {})
    crud = [e for e in built if e.op in ("i", "u", "d")]
    assert len(crud) > 5
    built.clear()
    whole_db = _read(d, start, {"database": True})
    # the database stream builds only what the collection stream did not see
    assert [e for e in built if e.op in ("i", "u", "d") and e.ns == "db.c"] == []
    assert _documents(whole_db) != _documents(collection)
    d.event_cache.clear()
    assert _read(d, start, {"database": True}) == whole_db  # the same bytes when built alone


def test_the_cache_is_emptied_once_no_stream_has_used_it_for_a_while() -> None:
    cache = EventCache(idle_seconds=0.05)
    release = cache.acquire()
    cache.put(1, "s", [object()], 100)
    release()
    deadline = time.monotonic() + 30
    while len(cache) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(cache) == 0 and cache.size == 0 and cache.readers == 0


def test_a_stream_coming_back_keeps_the_cache() -> None:
    cache = EventCache(idle_seconds=0.05)
    cache.acquire()()
    cache.put(1, "s", [object()], 100)  # (a reader that left just before)
    release = cache.acquire()
    cache.acquire()()  # the last but one reader leaves: someone still reads
    time.sleep(0.3)  # several idle periods
    assert cache.get(1, "s") is not None and cache.readers == 1
    release()


def test_streams_count_as_readers_until_closed_or_dropped() -> None:
    d, start = _workload("8.0")
    cache = d.event_cache
    assert cache.readers == 0
    body = {"aggregate": "c", "pipeline": [{"$changeStream": {"startAtOperationTime": start}}],
            "cursor": {"batchSize": 2}}  # fmt: skip
    first = int(_run(d, "db", body)["cursor"]["id"])
    second = int(_run(d, "db", body)["cursor"]["id"])
    assert cache.readers == 2
    d.cursors.kill(first, d.members[0].name)
    assert cache.readers == 1
    cursor = d.cursors.checkout(second, d.members[0].name)
    d.cursors.checkin(second)
    d.cursors._slots.clear()  # dropped without being closed (as a leak would)
    del cursor
    gc.collect()
    assert cache.readers == 0
