"""``EventParser``: what a typed stream delivers, from a mapping or raw BSON, equals ``parse_event``."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

import bson
import pytest
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from bson.son import SON

from changestream.events import (
    ChangeEvent,
    DeleteEvent,
    EventParser,
    InsertEvent,
    Namespace,
    UnknownEvent,
    UpdateEvent,
    parse_event,
)
from tests.client.test_events import CASES, HOSTILE, check_lossless, random_doc


def deferring() -> EventParser:
    """A parser that has just started its first sampling window: it defers."""
    return EventParser()


def from_bytes() -> Callable[[Mapping[str, Any]], Any]:
    """A stream's parser (a codec given) fed each document as raw BSON, as a typed stream is."""
    parser = EventParser(CodecOptions())
    return lambda doc: parser(RawBSONDocument(bson.encode(doc)))


def is_deferred(event: object) -> bool:
    return getattr(type(event), "_pending").__get__(event) is not None  # noqa: B009


def pending_or_none(event: object) -> object:
    try:
        return getattr(type(event), "_pending").__get__(event)  # noqa: B009
    except AttributeError:
        return None


PARSERS: list[Callable[[], Callable[[Mapping[str, Any]], Any]]] = [deferring, from_bytes]


@pytest.mark.parametrize("make", PARSERS, ids=["deferring", "from_bytes"])
@pytest.mark.parametrize(("doc", "cls", "expected"), CASES, ids=[c[1].__name__ for c in CASES])
def test_every_operation_type_equals_parse_event(
    make: Callable[[], Callable[[Mapping[str, Any]], Any]], doc: dict[str, Any],
    cls: type[ChangeEvent], expected: dict[str, Any],
) -> None:
    event = make()(doc)
    assert type(event) is cls
    assert event == parse_event(doc)
    for attr, value in expected.items():
        assert getattr(event, attr) == value
    if make is deferring:
        assert event.raw is doc
    else:  # the event decoded with the stream's codec
        assert type(event.raw) is dict and event.raw == doc


class _Str(str):
    pass


@pytest.mark.parametrize("make", PARSERS, ids=["deferring", "from_bytes"])
def test_two_key_namespaces_that_are_not_plain_never_hit_the_namespace_cache(
    make: Callable[[], Callable[[Mapping[str, Any]], Any]],
) -> None:
    # Warm the cache with ("d", "c") and ("d", None), then feed look-alikes of two keys.
    parser = make()
    doc = CASES[0][0]
    for ns in ({"db": "d", "coll": "c"}, {"db": "d"}):
        parser({**doc, "ns": ns}).ns  # type: ignore[union-attr]  # noqa: B018
    shapes: list[dict[str, Any]] = [
        {"db": "d", "other": 1},
        {"coll": "c", "other": 1},
        {"db": "d", "coll": ["c"]},
        {"db": ["d"], "coll": "c"},
        {"db": _Str("d"), "coll": "c"},
        {"db": "d", "coll": _Str("c")},
        {"db": "d", "coll": "c"},
    ]
    for ns in shapes:
        source = {**doc, "ns": ns}
        event = parser(source)
        assert event == parse_event(source)
        check_lossless(event.raw, event)  # the source itself, or its decoded bytes
    plain = parser({**doc, "ns": {"db": "d", "coll": "c"}})
    assert plain.ns == Namespace(db="d", coll="c") and plain.ns.extra == {}  # type: ignore[union-attr]
    assert parser({**doc, "ns": {"db": "d", "other": 1}}).ns == Namespace(  # type: ignore[union-attr]
        db="d", extra={"other": 1})


def test_a_deferred_event_has_its_class_before_any_field_is_read() -> None:
    doc = CASES[0][0]
    event = deferring()(doc)
    assert pending_or_none(event) is not None
    assert type(event) is InsertEvent and isinstance(event, ChangeEvent)
    match event:
        case DeleteEvent():
            pytest.fail("matched the wrong class")
        case InsertEvent():
            pass
    assert pending_or_none(event) is not None, "a class match must not parse the event"
    assert event.ns == Namespace(db="shop", coll="orders")
    assert pending_or_none(event) is None, "the first field read parses every field"
    assert event == parse_event(doc)


def test_random_and_hostile_documents_lose_nothing_when_deferred() -> None:
    rng = random.Random(20261122)
    parser = deferring()
    for i in range(2000):
        doc = random_doc(rng)
        if i % 2:
            doc = RawBSONDocument(bson.encode(doc))  # type: ignore[assignment]
        check_lossless(doc, parser(doc))
    for doc in HOSTILE:
        result = deferring()(doc)
        assert isinstance(result, ChangeEvent)
        check_lossless(doc, result)


@pytest.mark.parametrize("make", PARSERS, ids=["deferring", "from_bytes"])
def test_documents_that_are_not_events_come_back_unchanged(
    make: Callable[[], Callable[[Mapping[str, Any]], Any]],
) -> None:
    parser = make()
    for doc in ({"_id": 1, "x": 2}, {"operationType": 5}):
        assert parser(doc) == doc
    assert deferring()(doc) is doc
    raw = RawBSONDocument(bson.encode({"a": 1}))
    assert deferring()(raw) is raw


def test_unknown_operation_types_are_deferred_too() -> None:
    doc = {"_id": {"_data": "01"}, "operationType": "futureThing", "detail": {"a": 1}}
    event = deferring()(doc)
    assert type(event) is UnknownEvent
    assert event.operation_type == "futureThing"
    assert event.extra == {"detail": {"a": 1}}


def test_deferred_events_copy_pickle_compare_and_replace_like_parsed_ones() -> None:
    doc = CASES[1][0]  # an update
    parsed = parse_event(doc)
    assert pickle.loads(pickle.dumps(deferring()(doc))) == parsed
    assert copy.copy(deferring()(doc)) == parsed
    assert copy.deepcopy(deferring()(doc)) == parsed
    assert dataclasses.asdict(deferring()(doc)) == dataclasses.asdict(parsed)  # type: ignore[arg-type]
    assert repr(deferring()(doc)) == repr(parsed)
    replaced: Any = dataclasses.replace(deferring()(doc), txn_number=7)  # type: ignore[type-var]
    assert replaced.txn_number == 7
    event: Any = deferring()(doc)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.ns = None
    assert isinstance(event, UpdateEvent) and event.ns is not None


def test_missing_attributes_raise_attribute_error_on_every_kind_of_event() -> None:
    built = InsertEvent(resume_token=None, operation_type="insert")
    events: list[Any] = [deferring()(CASES[0][0]), from_bytes()(CASES[0][0]), built]
    for event in events:
        with pytest.raises(AttributeError, match="no attribute 'no_such_field'"):
            event.no_such_field  # noqa: B018
        assert not hasattr(event, "__no_such_dunder__")
    assert pending_or_none(built) is None


def test_an_event_read_from_bytes_is_decoded_on_first_read_only() -> None:
    """Delivered with its class and bytes; a skipped event is never decoded (damage unseen)."""
    parser = EventParser(CodecOptions())
    good = bytes(bson.encode(CASES[0][0]))
    event: Any = parser(RawBSONDocument(good))
    assert type(event) is InsertEvent and pending_or_none(event) is not None
    assert event.full_document == CASES[0][0]["fullDocument"]
    assert pending_or_none(event) is None, "the first field read fills every field"
    # The same event with the bytes of its last field damaged: delivered, its class known.
    damaged: Any = parser(RawBSONDocument(good[:-3] + b"\xff\xff\x00"))
    assert type(damaged) is InsertEvent
    with pytest.raises(bson.errors.InvalidBSON):
        damaged.ns  # noqa: B018


def test_events_from_bytes_of_other_layouts_and_types() -> None:
    """operationType not right after _id, unknown types and non-events: as parse_event on the decoded doc."""
    parser = EventParser(CodecOptions())
    docs: list[dict[str, Any]] = [
        {"operationType": "delete", "_id": {"_data": "01"}, "documentKey": {"_id": 1}},
        {"_id": {"_data": "01"}, "operationType": "futureThing", "detail": {"a": 1}},
        {"_id": {"_data": "01"}, "operationType": "inser"},
        {"_id": {"_data": "01"}, "operationType": "insertX"},
        {"_id": {"_data": "01"}, "x": 1},
        {"_id": 5, "operationType": "drop"},
    ]
    for doc in docs:
        result = parser(RawBSONDocument(bson.encode(doc)))
        expected = parse_event(doc)
        assert type(result) is type(expected)
        assert result == expected


def test_the_codec_decides_the_types_an_event_from_bytes_holds() -> None:
    doc = CASES[0][0]
    raw = RawBSONDocument(bson.encode(doc))
    event: Any = EventParser(CodecOptions(document_class=SON))(raw)
    assert type(event.full_document) is SON and type(event.raw) is SON
    event = EventParser(CodecOptions(document_class=RawBSONDocument))(raw)
    assert type(event.full_document) is RawBSONDocument and event.raw is raw
    assert event == parse_event(raw)


def test_concurrent_first_reads_see_the_same_values() -> None:
    doc = CASES[1][0]
    expected = parse_event(doc)
    for _ in range(50):
        event = deferring()(doc)
        seen: list[Mapping[str, Any]] = []
        barrier = threading.Barrier(4)

        def read(event: Any = event, barrier: threading.Barrier = barrier,
                 seen: list[Mapping[str, Any]] = seen) -> None:
            barrier.wait()
            seen.append(dataclasses.asdict(event))

        threads = [threading.Thread(target=read) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert seen == [dataclasses.asdict(expected)] * 4  # type: ignore[arg-type]
        assert type(event) is type(expected)


def _variants(rng: random.Random, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Documents of the same shape with surprises in one value, and of other shapes."""
    out = [dict(doc)]
    keys = [k for k in doc if k != "operationType"]
    for key in keys:
        for value in (None, 5, "text", [1], {"x": 1}, RawBSONDocument(bson.encode({"y": 2}))):
            out.append({**doc, key: value})
        out.append({k: v for k, v in doc.items() if k != key})  # a key fewer
    out.append({**doc, "newFieldFromAFutureServer": {"a": 1}})  # a key more
    shuffled = list(doc.items())
    rng.shuffle(shuffled)
    out.append(dict(shuffled))  # same keys, another order
    out.append({**doc, "ns": {"db": f"db{rng.randrange(10**6)}", "coll": "c"}})  # uncached ns
    return out


def test_events_from_bytes_give_exactly_what_parse_event_gives() -> None:
    """A stream's parser against the general reader: every case, its variants, random documents."""
    rng = random.Random(16)
    parser = EventParser(CodecOptions())
    docs = [case[0] for case in CASES]
    variants = [v for doc in docs for v in [*_variants(rng, doc), doc]]
    variants += [random_doc(rng) for _ in range(3000)]
    for doc in variants:
        try:
            raw = RawBSONDocument(bson.encode(doc))
        except (bson.errors.InvalidDocument, TypeError):
            continue  # not BSON: a stream never sees it
        decoded = bson.decode(raw.raw)
        expected = parse_event(decoded)
        result = parser(raw)
        assert type(result) is type(expected)
        assert result == expected
        if isinstance(expected, ChangeEvent):
            assert isinstance(result, ChangeEvent)
            assert dict(result.extra) == dict(expected.extra)
            assert result.raw == decoded


def test_insert_and_replace_with_the_same_keys_keep_their_own_classes() -> None:
    parser = from_bytes()
    insert = {"_id": {"_data": "01"}, "operationType": "insert", "ns": {"db": "d", "coll": "c"},
              "documentKey": {"_id": 1}, "fullDocument": {"_id": 1}}
    replace = {**insert, "operationType": "replace"}
    for _ in range(3):
        assert type(parser(insert)) is InsertEvent
        assert type(parser(replace)).__name__ == "ReplaceEvent"
        assert parser(replace) == parse_event(replace)


def test_the_operation_type_read_from_bytes_is_the_decoded_one_or_none() -> None:
    """``consume`` reads a raw event's ``operationType`` from its bytes (no inflated dict per
    change): the decoded value whenever it answers, ``None`` (the caller decodes) for any
    other layout, and never an exception on damaged bytes."""
    from changestream._consumer.dead_ends import operation_type
    from changestream._event_build import raw_operation_type

    rng = random.Random(5)
    docs = [*(case[0] for case in CASES), *HOSTILE, *(random_doc(rng) for _ in range(200)),
            {"_id": {"_data": "00"}, "operationType": "somethingNew", "x": 1},
            {"_id": {"_data": "00"}, "operationType": "caf\u00e9"},
            {"operationType": "insert", "_id": {"_data": "00"}},  # not after _id: decoded
            {"_id": {"_data": "00"}, "operationType": 5}]
    answered = 0
    for doc in docs:
        try:
            raw = bson.encode(doc)
        except bson.errors.InvalidDocument:
            continue  # (some hostile cases are no BSON)
        found = raw_operation_type(raw)
        assert raw_operation_type(memoryview(raw)) == found
        if found is not None:
            answered += 1
            assert found == doc.get("operationType")
        if isinstance(doc.get("operationType"), str):  # (what consume compares)
            assert operation_type(RawBSONDocument(raw)) == doc["operationType"]
        for cut in range(0, len(raw), max(1, len(raw) // 40)):  # damaged: never raises
            damaged = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
            result = raw_operation_type(damaged)
            assert result is None or isinstance(result, str)
            raw_operation_type(raw[:cut])
    assert answered >= len(CASES)  # the server's layout is read from the bytes
