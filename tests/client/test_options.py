"""Unit tests of watch() option validation, target resolution and result decoding (no server)."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import bson
import pytest
from bson.binary import Binary, UuidRepresentation
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from bson.timestamp import Timestamp
from pymongo import MongoClient, ReadPreference
from pymongo.collation import Collation
from pymongo.read_concern import ReadConcern

import changestream
from changestream._options import (
    ChangeStreamOptions,
    check_max_await,
    effective_codec_options,
    effective_timeout_ms,
    event_decoder,
    resolve_target,
)
from changestream._token import ResumeToken


@pytest.fixture
def client() -> Iterator[MongoClient[dict[str, Any]]]:
    """A client that never connects (port 1, connect=False)."""
    mongo: MongoClient[dict[str, Any]] = MongoClient(
        "mongodb://127.0.0.1:1/?timeoutMS=2000", connect=False,
        readPreference="secondaryPreferred", readConcernLevel="majority",
    )
    yield mongo
    mongo.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"pipeline": {"$match": {}}}, TypeError, "pipeline must be a list"),
        ({"pipeline": [{"$match": {}}, "x"]}, TypeError, "pipeline stage 1 must be a document"),
        ({"full_document": {"x": 1}}, TypeError, "full_document must be a string"),
        ({"full_document_before_change": 1}, TypeError, "full_document_before_change must be"),
        ({"resume_after": "token"}, TypeError, "resume_after must be a document"),
        ({"start_after": [1]}, TypeError, "start_after must be a document"),
        ({"start_at_operation_time": 5}, TypeError, "start_at_operation_time must be"),
        ({"batch_size": -1}, ValueError, "batch_size must be >= 0"),
        ({"batch_size": 1.5}, TypeError, "batch_size must be an integer"),
        ({"batch_size": True}, TypeError, "batch_size must be an integer"),
        ({"max_await_time_ms": "10"}, TypeError, "max_await_time_ms must be an integer"),
        ({"timeout_ms": -1}, ValueError, "timeout_ms must be >= 0"),
        ({"timeout_ms": float("nan")}, ValueError, "timeout_ms must be a finite number, not nan"),
        ({"timeout_ms": float("inf")}, ValueError, "timeout_ms must be a finite number, not inf"),
        ({"timeout_ms": 1e300}, ValueError, "timeout_ms must be at most 2147483647"),
        ({"max_await_time_ms": 2**40}, ValueError, "max_await_time_ms must be at most"),
        ({"collation": "fr"}, TypeError, "collation"),
        ({"show_expanded_events": "yes"}, TypeError, "show_expanded_events must be a bool"),
        ({"typed": 1}, TypeError, "typed must be a bool"),
        ({"reassemble_split_events": None}, TypeError, "reassemble_split_events must be a bool"),
        ({"read_preference": "secondary"}, TypeError, "read_preference must be"),
        ({"read_concern": "majority"}, TypeError, "read_concern must be"),
        ({"session": object()}, TypeError, "session must be"),
        ({"codec_options": {}}, TypeError, "codec_options must be"),
        ({"document_class": SON()}, TypeError, "document_class must be a class"),
        ({"fullDocument": "updateLookup"}, TypeError, "unexpected option"),
    ],
)
def test_wrong_types_raise_one_clear_error(kwargs: dict[str, Any], error: type, message: str) -> None:
    pipeline = kwargs.pop("pipeline", None)
    with pytest.raises(error, match=message):
        ChangeStreamOptions.from_kwargs(pipeline, **kwargs)


def test_values_the_server_understands_are_not_validated() -> None:
    options = ChangeStreamOptions.from_kwargs(
        [{"$changeStream": {}}, {"$unknownStage": 1}],
        full_document="notAValue",
        full_document_before_change="alsoNot",
        resume_after={"_data": "00"},
        start_after={"_data": "01"},
        start_at_operation_time=Timestamp(1, 1),
    )
    assert options.full_document == "notAValue"
    assert options.pipeline[0] == {"$changeStream": {}}


def test_inputs_are_copied() -> None:
    stage = {"$match": {"x": 1}}
    token = {"_data": "AA"}
    options = ChangeStreamOptions.from_kwargs([stage], resume_after=token)
    stage["$match"]["x"] = 2
    token["_data"] = "BB"
    assert options.pipeline == ({"$match": {"x": 1}},)
    assert options.resume_after == {"_data": "AA"}


def test_collation_object_becomes_its_document() -> None:
    options = ChangeStreamOptions.from_kwargs(collation=Collation("fr", strength=2))
    assert options.collation == {"locale": "fr", "strength": 2}


def test_resolve_each_target_kind(client: MongoClient[dict[str, Any]]) -> None:
    collection = resolve_target(client.db.coll)
    assert (collection.database, collection.collection, collection.cluster) == ("db", "coll", False)
    database = resolve_target(client.db)
    assert (database.database, database.collection, database.cluster) == ("db", None, False)
    cluster = resolve_target(client)
    assert (cluster.database, cluster.collection, cluster.cluster) == ("admin", None, True)
    assert cluster.client is client
    assert collection.read_preference == ReadPreference.SECONDARY_PREFERRED
    assert collection.read_concern == ReadConcern("majority")
    with pytest.raises(TypeError, match="must be a pymongo MongoClient, Database or Collection"):
        resolve_target("db.coll")


def test_timeout_inherits_the_client_and_checks_max_await(client: MongoClient[dict[str, Any]]) -> None:
    inherited = ChangeStreamOptions.from_kwargs(max_await_time_ms=1999)
    assert effective_timeout_ms(inherited, client) == 2000
    check_max_await(inherited, 2000)
    explicit = ChangeStreamOptions.from_kwargs(max_await_time_ms=10, timeout_ms=10)
    assert effective_timeout_ms(explicit, client) == 10
    with pytest.raises(ValueError, match=r"max_await_time_ms \(10\) must be less than timeout_ms"):
        check_max_await(explicit, 10)
    check_max_await(ChangeStreamOptions.from_kwargs(max_await_time_ms=10, timeout_ms=0), 0)


def test_watch_rejects_bad_options_before_any_io(client: MongoClient[dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="max_await_time_ms"):
        changestream.watch(client.db.coll, max_await_time_ms=5, timeout_ms=5)
    with pytest.raises(ValueError, match="max_await_time_ms"):
        changestream.watch(client.db.coll, max_await_time_ms=2000)  # client timeoutMS=2000
    with pytest.raises(TypeError, match="pipeline must be a list"):
        changestream.Client(client).db.coll.watch({"$match": {}})  # type: ignore[arg-type]


def test_codec_options_and_document_class(client: MongoClient[dict[str, Any]]) -> None:
    target = resolve_target(client.db.coll)
    codec = effective_codec_options(ChangeStreamOptions.from_kwargs(document_class=SON), target)
    assert codec.document_class is SON
    custom = CodecOptions(tz_aware=True)
    codec = effective_codec_options(
        ChangeStreamOptions.from_kwargs(codec_options=custom, document_class=OrderedDict), target
    )
    assert codec.tz_aware and codec.document_class is OrderedDict


RAW_EVENT = RawBSONDocument(bson.encode({
    "_id": {"_data": "82AA"},
    "operationType": "insert",
    "documentKey": {"_id": Binary(uuid.UUID(int=1).bytes, 4)},
    "fullDocument": {"a": {"b": 1}},
}))


def test_event_decoder_uses_the_users_codec() -> None:
    as_dict = event_decoder(CodecOptions(uuid_representation=UuidRepresentation.STANDARD), False)
    decoded = as_dict(RAW_EVENT)
    assert type(decoded) is dict and type(decoded["fullDocument"]) is dict
    assert decoded["documentKey"]["_id"] == uuid.UUID(int=1)
    as_son = event_decoder(CodecOptions(document_class=SON), False)(RAW_EVENT)
    assert isinstance(as_son, SON) and isinstance(as_son["fullDocument"], SON)
    merged = event_decoder(CodecOptions(), False)({"_id": RawBSONDocument(bson.encode({"x": 1}))})
    assert merged == {"_id": {"x": 1}}


def test_event_decoder_raw_output_keeps_bytes() -> None:
    raw = event_decoder(CodecOptions(document_class=RawBSONDocument), False)(RAW_EVENT)
    assert isinstance(raw, RawBSONDocument) and raw.raw == RAW_EVENT.raw


def test_event_decoder_typed_returns_events() -> None:
    from changestream import events

    typed = event_decoder(CodecOptions(), True)(RAW_EVENT)
    assert isinstance(typed, events.ChangeEvent)
    assert typed == events.parse_event(bson.decode(RAW_EVENT.raw))


def test_present_token_follows_document_class() -> None:
    raw = RawBSONDocument(bson.encode({"_data": "82AA", "_typeBits": Binary(b"\x01", 0)}))
    as_dict = ResumeToken.present(raw, CodecOptions())
    assert type(as_dict) is dict and bson.encode(as_dict) == raw.raw
    assert ResumeToken.present(raw, CodecOptions(document_class=RawBSONDocument)) is raw
    user = {"_data": "82BB"}
    copy = ResumeToken.present(user, CodecOptions())
    assert copy == user and copy is not user
    assert ResumeToken.present(None, CodecOptions()) is None
