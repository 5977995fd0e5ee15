"""``EventParser``: what a typed stream delivers, deferred or not, equals ``parse_event``."""

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
from bson.raw_bson import RawBSONDocument

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


def eager() -> EventParser:
    """A parser whose consumer read every event of a window: it parses on delivery."""
    parser = EventParser()
    for _ in range(EventParser.WINDOW):
        event = parser({"_id": {"_data": "00"}, "operationType": "drop"})
        assert isinstance(event, ChangeEvent)
        _ = event.ns
    return parser


def is_deferred(event: object) -> bool:
    return getattr(type(event), "_pending").__get__(event) is not None  # noqa: B009


def pending_or_none(event: object) -> object:
    try:
        return getattr(type(event), "_pending").__get__(event)  # noqa: B009
    except AttributeError:
        return None


PARSERS: list[Callable[[], EventParser]] = [deferring, eager]


@pytest.mark.parametrize("make", PARSERS, ids=["deferring", "eager"])
@pytest.mark.parametrize(("doc", "cls", "expected"), CASES, ids=[c[1].__name__ for c in CASES])
def test_every_operation_type_equals_parse_event(
    make: Callable[[], EventParser], doc: dict[str, Any], cls: type[ChangeEvent],
    expected: dict[str, Any],
) -> None:
    event = make()(doc)
    assert type(event) is cls
    assert event == parse_event(doc)
    for attr, value in expected.items():
        assert getattr(event, attr) == value
    assert event.raw is doc


class _Str(str):
    pass


@pytest.mark.parametrize("make", PARSERS, ids=["deferring", "eager"])
def test_two_key_namespaces_that_are_not_plain_never_hit_the_namespace_cache(
    make: Callable[[], EventParser],
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
        check_lossless(source, event)
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


@pytest.mark.parametrize("make", PARSERS, ids=["deferring", "eager"])
def test_documents_that_are_not_events_come_back_unchanged(make: Callable[[], EventParser]) -> None:
    parser = make()
    for doc in ({"_id": 1, "x": 2}, {"operationType": 5}, RawBSONDocument(bson.encode({"a": 1}))):
        assert parser(doc) is doc


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
    events: list[Any] = [deferring()(CASES[0][0]), eager()(CASES[0][0]), built]
    for event in events:
        with pytest.raises(AttributeError, match="no attribute 'no_such_field'"):
            event.no_such_field  # noqa: B018
        assert not hasattr(event, "__no_such_dunder__")
    assert pending_or_none(built) is None


def test_the_parser_parses_on_delivery_once_the_consumer_reads_most_events() -> None:
    parser = EventParser()
    doc = CASES[0][0]
    for _ in range(EventParser.WINDOW):
        event = parser(doc)
        assert is_deferred(event)
        _ = event.full_document  # type: ignore[union-attr]
    for _ in range(EventParser.EAGER_RUN):
        assert pending_or_none(parser(doc)) is None  # parsed on delivery
    assert is_deferred(parser(doc)), "after an eager run it samples again"


def test_the_parser_keeps_deferring_while_the_consumer_skips_events() -> None:
    parser = EventParser()
    doc = CASES[0][0]
    for i in range(10 * EventParser.WINDOW):
        event = parser(doc)
        assert is_deferred(event)
        if i % 4 == 0:  # reads a quarter of them
            _ = event.ns  # type: ignore[union-attr]


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


def _same(result: object, expected: object) -> None:
    """Equal, of the same class, with the same ``extra`` and the very same ``raw``."""
    assert type(result) is type(expected)
    assert result == expected
    if isinstance(expected, ChangeEvent):
        assert isinstance(result, ChangeEvent)
        assert dict(result.extra) == dict(expected.extra)
        assert result.raw is expected.raw


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


def test_shape_readers_give_exactly_what_parse_event_gives() -> None:
    """The eager parser's per-shape readers against the general reader, shape after shape.

    One parser sees every case, its variants (same keys with a value of another
    type, keys missing or added, another order, a namespace not yet cached),
    then the case again: each result is what :func:`parse_event` gives.
    """
    rng = random.Random(16)
    parser = eager()
    docs = [case[0] for case in CASES]
    for doc in docs:
        for variant in [*_variants(rng, doc), doc]:
            _same(parser(variant), parse_event(variant))
    for _ in range(3000):  # random documents, many sharing the same few keys
        doc = random_doc(rng)
        _same(parser(doc), parse_event(doc))
    for doc in HOSTILE:
        _same(parser(doc), parse_event(doc))


def test_insert_and_replace_with_the_same_keys_keep_their_own_classes() -> None:
    parser = eager()
    insert = {"_id": {"_data": "01"}, "operationType": "insert", "ns": {"db": "d", "coll": "c"},
              "documentKey": {"_id": 1}, "fullDocument": {"_id": 1}}
    replace = {**insert, "operationType": "replace"}
    for _ in range(3):
        assert type(parser(insert)) is InsertEvent
        assert type(parser(replace)).__name__ == "ReplaceEvent"
        _same(parser(replace), parse_event(replace))


def test_a_parser_keeps_at_most_max_shapes_readers() -> None:
    parser = eager()
    for i in range(EventParser.MAX_SHAPES * 3):
        doc = {"_id": {"_data": "01"}, "operationType": "insert", f"k{i}": i}
        _same(parser(doc), parse_event(doc))
    assert len(parser._shapes) == EventParser.MAX_SHAPES
