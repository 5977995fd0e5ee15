"""The unified-format matcher, without a server: operators, root vs nested, numerics."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from bson import encode
from bson.binary import Binary
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp

from spec_tests.runner import RunnerError
from spec_tests.runner.loader import parse_extended_json
from spec_tests.runner.matcher import MatchError, bson_type, match


class FakeEntities:
    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def bson_entity(self, name: str) -> Any:
        if name not in self.values:
            raise RunnerError(f"entity {name!r} is not defined")
        return self.values[name]

    def session_lsid(self, name: str) -> Mapping[str, Any]:
        return {"id": self.bson_entity(name)}


def ok(expected: Any, actual: Any, **kwargs: Any) -> None:
    match(expected, actual, **kwargs)


def bad(expected: Any, actual: Any, fragment: str = "", **kwargs: Any) -> None:
    with pytest.raises(MatchError) as info:
        match(expected, actual, **kwargs)
    assert fragment in str(info.value)


# -- root vs nested --------------------------------------------------------------
def test_root_document_allows_extra_keys() -> None:
    ok({"x": 1}, {"x": 1, "y": 2})


def test_nested_document_rejects_extra_keys() -> None:
    bad({"x": {"y": 1}}, {"x": {"y": 1, "z": 1}}, "unexpected keys ['z']")


def test_non_root_match_rejects_extra_keys_at_top() -> None:
    bad({"x": 1}, {"x": 1, "y": 2}, "unexpected keys", root=False)


def test_empty_nested_document_must_be_empty() -> None:
    # {$changeStream: {}} means the driver sent no change-stream options at all.
    expected: dict[str, Any] = {"pipeline": [{"$changeStream": {}}]}
    ok(expected, {"pipeline": [{"$changeStream": {}}], "lsid": {"id": 1}})
    bad(expected, {"pipeline": [{"$changeStream": {"fullDocument": "default"}}]}, "fullDocument")


def test_documents_inside_arrays_are_nested() -> None:
    bad([{"a": 1}], [{"a": 1, "b": 2}], "unexpected keys")


def test_missing_key_fails_with_path() -> None:
    bad({"ns": {"db": "d", "coll": "c"}}, {"ns": {"db": "d"}}, "$.ns.coll")


def test_key_order_does_not_matter() -> None:
    ok({"ns": {"db": "d", "coll": "c"}}, {"ns": {"coll": "c", "db": "d"}})


def test_raw_bson_documents_are_matched_as_documents() -> None:
    raw = RawBSONDocument(encode({"a": {"b": 1}}))
    ok({"a": {"b": 1}}, raw)
    bad({"a": {"b": 2}}, raw, "$.a.b")


def test_document_against_scalar_fails() -> None:
    bad({"a": 1}, 5, "expected a document")
    bad(5, {"a": 1}, "expected")


# -- arrays ------------------------------------------------------------------------
def test_arrays_must_have_the_same_length() -> None:
    ok([1, 2, 3], [1, 2, 3])
    bad([1, 2, 3], [1, 2, 3, 4], "expected 3 elements, got 4")
    bad([1, 2], [1], "expected 2 elements")


def test_array_elements_match_in_order() -> None:
    bad([1, 2], [2, 1], "$[0]")


# -- numbers and scalar types ----------------------------------------------------------
@pytest.mark.parametrize("actual", [1, 1.0, Int64(1)])
def test_numbers_compare_across_int_long_double(actual: Any) -> None:
    ok({"n": 1}, {"n": actual})
    ok({"n": Int64(1)}, {"n": actual})
    ok({"n": 1.0}, {"n": actual})


def test_numbers_must_be_equal_in_value() -> None:
    bad({"n": 1}, {"n": 1.5}, "got double 1.5")


def test_bool_is_not_a_number() -> None:
    bad({"n": 1}, {"n": True})
    bad({"n": True}, {"n": 1})


def test_decimal_is_not_flexible() -> None:
    bad({"n": 1}, {"n": Decimal128("1")})
    ok({"n": Decimal128("1.5")}, {"n": Decimal128("1.5")})


def test_strings_and_nulls_are_typed() -> None:
    bad({"s": "1"}, {"s": 1})
    ok({"s": None}, {"s": None})
    bad({"s": None}, {"s": 0}, "expected null")


def test_binary_uuid_date_and_timestamp_values() -> None:
    u = uuid.uuid4()
    ok({"b": Binary(u.bytes, 4)}, {"b": Binary(u.bytes, 4)})
    ok({"b": Binary(b"xy", 0)}, {"b": b"xy"})
    bad({"b": Binary(b"xy", 5)}, {"b": b"xy"})
    when = datetime.datetime(2024, 1, 2, 3, 4, 5, 678000)
    ok({"d": when.replace(tzinfo=datetime.timezone.utc)}, {"d": when})
    ok({"t": Timestamp(5, 1)}, {"t": Timestamp(5, 1)})
    bad({"t": Timestamp(5, 1)}, {"t": Timestamp(5, 2)})


def test_bson_type_names() -> None:
    assert bson_type(1) == "int"
    assert bson_type(2**40) == "long"
    assert bson_type(Int64(1)) == "long"
    assert bson_type(1.0) == "double"
    assert bson_type(True) == "bool"
    assert bson_type({}) == "object"
    assert bson_type([]) == "array"
    assert bson_type(ObjectId()) == "objectId"
    assert bson_type(Timestamp(1, 1)) == "timestamp"
    assert bson_type(b"") == "binData"
    assert bson_type(None) == "null"
    with pytest.raises(RunnerError):
        bson_type(object())


# -- $$exists ---------------------------------------------------------------------
def test_exists_true_accepts_any_value_including_null() -> None:
    ok({"a": {"$$exists": True}}, {"a": None})
    bad({"a": {"$$exists": True}}, {"b": 1}, "key is missing")


def test_exists_false_requires_absence() -> None:
    ok({"a": {"$$exists": False}}, {"b": 1})
    bad({"a": {"$$exists": False}}, {"a": None}, "expected $$exists: false")


def test_exists_in_nested_document_counts_as_expected_key() -> None:
    ok({"x": {"a": {"$$exists": True}, "b": 1}}, {"x": {"a": 5, "b": 1}})
    ok({"x": {"a": {"$$exists": False}, "b": 1}}, {"x": {"b": 1}})


def test_exists_outside_a_document_is_a_runner_error() -> None:
    with pytest.raises(RunnerError):
        match({"$$exists": True}, 1)


# -- $$unsetOrMatches --------------------------------------------------------------------
def test_unset_or_matches_as_a_key_value() -> None:
    expected = {"resumeAfter": {"$$unsetOrMatches": {"$$exists": True}}}
    ok({"$changeStream": expected}, {"$changeStream": {}})
    ok({"$changeStream": expected}, {"$changeStream": {"resumeAfter": {"_data": "00"}}})
    bad(
        {"$changeStream": expected},
        {"$changeStream": {"startAtOperationTime": Timestamp(1, 1)}},
        "startAtOperationTime",
    )


def test_unset_or_matches_value_must_match_when_present() -> None:
    ok({"a": {"$$unsetOrMatches": 2}}, {})
    ok({"a": {"$$unsetOrMatches": 2}}, {"a": 2})
    bad({"a": {"$$unsetOrMatches": 2}}, {"a": 3})


def test_unset_or_matches_does_not_make_documents_root() -> None:
    bad({"a": {"$$unsetOrMatches": {"b": 1}}}, {"a": {"b": 1, "c": 2}}, "unexpected keys")


def test_unset_or_matches_for_a_whole_result() -> None:
    ok({"$$unsetOrMatches": {"x": 1}}, None)
    ok({"$$unsetOrMatches": {"x": 1}}, {"x": 1, "y": 2})


# -- $$type ------------------------------------------------------------------------------
def test_type_single_and_list() -> None:
    ok({"getMore": {"$$type": ["int", "long"]}}, {"getMore": Int64(123)})
    ok({"getMore": {"$$type": ["int", "long"]}}, {"getMore": 5})
    bad({"getMore": {"$$type": "int"}}, {"getMore": Int64(5)}, "got long")
    ok({"_id": {"$$type": "objectId"}}, {"_id": ObjectId()})
    ok({"d": {"$$type": "object"}}, {"d": {"any": 1}})


def test_type_checks_array_itself_not_elements() -> None:
    ok({"a": {"$$type": "array"}}, {"a": [1, "x"]})
    bad({"a": {"$$type": "int"}}, {"a": [1]})


def test_type_inside_array_elements() -> None:
    ok({"paths": ["a", {"$$type": "int"}]}, {"paths": ["a", 0]})
    bad({"paths": ["a", {"$$type": "int"}]}, {"paths": ["a", "0"]}, "$.paths[1]")


def test_type_needs_the_key_to_exist() -> None:
    bad({"a": {"$$type": "null"}}, {}, "key is missing")


def test_type_number_alias_and_unknown_type() -> None:
    ok({"n": {"$$type": "number"}}, {"n": 1.5})
    with pytest.raises(RunnerError):
        match({"n": {"$$type": "integer"}}, {"n": 1})


# -- the other operators -------------------------------------------------------------------
def test_matches_entity() -> None:
    entities = FakeEntities({"savedId": ObjectId("000000000000000000000001")})
    ok(
        {"_id": {"$$matchesEntity": "savedId"}},
        {"_id": ObjectId("000000000000000000000001")},
        entities=entities,
    )
    bad({"_id": {"$$matchesEntity": "savedId"}}, {"_id": ObjectId()}, entities=entities)
    with pytest.raises(RunnerError):
        match({"_id": {"$$matchesEntity": "missing"}}, {"_id": 1}, entities=entities)


def test_session_lsid() -> None:
    entities = FakeEntities({"session0": Binary(b"0" * 16, 4)})
    ok(
        {"lsid": {"$$sessionLsid": "session0"}},
        {"lsid": {"id": Binary(b"0" * 16, 4)}},
        entities=entities,
    )
    bad(
        {"lsid": {"$$sessionLsid": "session0"}},
        {"lsid": {"id": Binary(b"1" * 16, 4)}},
        entities=entities,
    )


def test_lte_is_numeric_and_flexible() -> None:
    ok({"n": {"$$lte": 1}}, {"n": 1.0})
    ok({"n": {"$$lte": 1}}, {"n": Int64(0)})
    bad({"n": {"$$lte": 1}}, {"n": 1.1}, "expected <= 1")
    bad({"n": {"$$lte": 1}}, {"n": "0"})


def test_match_as_document_parses_extended_json_as_nested() -> None:
    ok({"c": {"$$matchAsDocument": {"x": Int64(1)}}}, {"c": '{"x": 1}'})
    bad({"c": {"$$matchAsDocument": {"x": 1}}}, {"c": '{"x": 1, "y": 2}'}, "unexpected keys")
    ok({"c": {"$$matchAsDocument": {"$$matchAsRoot": {"x": 1}}}}, {"c": '{"x": 1, "y": 2}'})


def test_match_as_root_allows_extra_keys_in_nested_document() -> None:
    ok({"a": {"$$matchAsRoot": {"x": 1}}}, {"a": {"x": 1, "y": 2}})
    bad({"a": {"$$matchAsRoot": {"x": 2}}}, {"a": {"x": 1, "y": 2}})


def test_matches_hex_bytes() -> None:
    ok({"b": {"$$matchesHexBytes": "0aFF"}}, {"b": b"\x0a\xff"})
    bad({"b": {"$$matchesHexBytes": "00"}}, {"b": b"\x01"})
    with pytest.raises(RunnerError):
        match({"b": {"$$matchesHexBytes": "0"}}, {"b": b""})


def test_unknown_special_operator_is_loud() -> None:
    with pytest.raises(RunnerError, match=r"\$\$placeholder"):
        match({"a": {"$$placeholder": 1}}, {"a": 1})


def test_two_dollar_keys_are_not_an_operator() -> None:
    # Only a document whose single key starts with $$ is an operator.
    bad({"a": {"$$exists": True, "b": 1}}, {"a": {"b": 1}}, "$$exists")


# -- with the loader's Extended JSON ----------------------------------------------------------
def test_extended_json_expectations() -> None:
    expected = parse_extended_json(
        '{"clusterTime": {"$$type": "timestamp"}, "n": {"$numberLong": "3"},'
        ' "t": {"$timestamp": {"t": 1, "i": 2}}}'
    )
    ok(expected, {"clusterTime": Timestamp(9, 9), "n": 3, "t": Timestamp(1, 2), "extra": 1})
    assert isinstance(expected["n"], Int64)
