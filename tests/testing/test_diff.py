"""compute_diff / diff_or_replacement against mongod's document_diff_calculator_test.cpp."""

from __future__ import annotations

from typing import Any

import bson
import pytest
from bson.int64 import Int64

from changestream.testing.changestreams.update_description import update_description
from changestream.testing.update.diff import (
    DELTA_OPLOG_ENTRY_PADDING,
    compute_diff,
    diff_or_replacement,
)

# (name, pre, post, padding, expected diff) — cases from mongod's unit tests, which
# compare the serialized diffs byte for byte.
SERVER_CASES: list[tuple[str, dict[str, Any], dict[str, Any], int, dict[str, Any]]] = [
    ("simple insert", {"a": {"b": 1}}, {"a": {"b": 1}, "c": 1}, 0, {"i": {"c": 1}}),
    ("simple update", {"a": {"b": 1}, "c": 1}, {"a": {"b": 1}, "c": 2}, 0, {"u": {"c": 2}}),
    ("simple delete", {"a": {"b": 1}, "c": 1}, {"a": {"b": 1}}, 0, {"d": {"c": False}}),
    (
        "insert nested single",
        {"a": {}, "e": 1, "f": 1},
        {"a": {"b": {"c": {"d": 1}}}, "e": 1, "f": 1},
        0,
        {"u": {"a": {"b": {"c": {"d": 1}}}}},
    ),
    (
        "insert nested multiple",
        {"a": 1, "g": 1, "h": 1},
        {"a": {"b": 2, "c": [2], "d": {"e": 2}, "f": 1}, "g": 1, "h": 1},
        0,
        {"u": {"a": {"b": 2, "c": [2], "d": {"e": 2}, "f": 1}}},
    ),
    (
        "update nested object",
        {"a": {"b": {"c": {"d": 1, "e": 1, "f": 1}}}},
        {"a": {"b": {"c": {"d": 2, "e": 1, "f": 1}}}},
        0,
        {"sa": {"sb": {"sc": {"u": {"d": 2}}}}},
    ),
    (
        "update nested array",
        {"a": {"b": {"c": {"d": [1], "e": 1, "f": 1}}}},
        {"a": {"b": {"c": {"d": [2], "e": 1, "f": 1}}}},
        0,
        {"sa": {"sb": {"sc": {"u": {"d": [2]}}}}},
    ),
    (
        "delete nested object",
        {"a": {"b": {"c": {"d": 1}, "e": 1, "f": 1}}},
        {"a": {"b": {"c": {}, "e": 1, "f": 1}}},
        0,
        {"sa": {"sb": {"u": {"c": {}}}}},
    ),
    (
        "delete and insert field at the end",
        {"a": 1, "b": "valueString", "c": 3, "d": 4},
        {"b": "valueString", "c": 3, "d": 4, "a": 1},
        15,
        {"i": {"a": 1}},
    ),
    (
        "deletes in ascending order of field names",
        {"b": 1, "a": 2, "c": 3, "d": 4, "e": "valueString"},
        {"c": 3, "d": 4, "e": "valueString"},
        15,
        {"d": {"a": False, "b": False}},
    ),
    (
        "trailing deletes first, then mismatched names in order",
        {"b": 1, "a": 2, "c": "value", "d": "valueString", "e": "valueString", "g": 1, "f": 1},
        {"c": "value", "d": "valueString", "e": "valueString"},
        15,
        {"d": {"g": False, "f": False, "a": False, "b": False}},
    ),
    (
        "double to int",
        {"a": "valueString", "b": 2, "c": {"subField1": 1, "subField2": 3.0}, "d": 4},
        {"a": "valueString", "b": 2, "c": {"subField1": 1, "subField2": 3}, "d": 4},
        15,
        {"sc": {"u": {"subField2": 3}}},
    ),
    (
        "int to long",
        {"a": "valueString", "b": 2, "c": {"subField1": 1, "subField2": 3}, "d": 4},
        {"a": "valueString", "b": 2, "c": {"subField1": 1, "subField2": Int64(3)}, "d": 4},
        15,
        {"sc": {"u": {"subField2": Int64(3)}}},
    ),
    (
        "field order",
        {"a": 1, "b": 2, "c": {"p": 1, "q": 1, "s": 1, "r": 2}, "d": 4},
        {"a": 1, "b": 2, "c": {"p": 1, "q": 1, "r": 2, "s": 1}, "d": 4},
        10,
        {"sc": {"i": {"s": 1}}},
    ),
    (
        "array push",
        {"field1": "abcd", "field2": [1, 2, 3]},
        {"field1": "abcd", "field2": [1, 2, 3, 4]},
        5,
        {"sfield2": {"a": True, "u3": 4}},
    ),
    (
        "nested array whose sub-diff is too large",
        {"field1": "abcd", "field2": [1, 2, 3, [[2]]]},
        {"field1": "abcd", "field2": [1, 2, 3, [[4]]]},
        0,
        {"sfield2": {"a": True, "u3": [[4]]}},
    ),
    (
        "nested array resize",
        {"field1": "abcd", "field2": [1, 2, 3, [1, "longString", [2], 4, 5, 6], 5, 5, 5]},
        {"field1": "abcd", "field2": [1, 2, 3, [1, "longString", [4], 4], 5, 6]},
        0,
        {"sfield2": {"a": True, "l": 6, "s3": {"a": True, "l": 4, "u2": [4]}, "u5": 6}},
    ),
    (
        "empty field names",
        {"": "1", "field2": [1, 2, 3, {"": {"": 1, "padding": "largeFieldValue"}}]},
        {"": "2", "field2": [1, 2, 3, {"": {"": 2, "padding": "largeFieldValue"}}]},
        15,
        {"u": {"": "2"}, "sfield2": {"a": True, "s3": {"s": {"u": {"": 2}}}}},
    ),
    (
        "object in array, array updates",
        {
            "field1": "abcd",
            "field2": [1, 2, 3, {"field3": ["veryLargeStringValueveryLargeStringValue", 2, 3, 4]}],
        },
        {
            "field1": "abcd",
            "field2": [
                1,
                2,
                3,
                {"field3": ["veryLargeStringValueveryLargeStringValue", 2, 4, 3, 5]},
            ],
        },
        0,
        {"sfield2": {"a": True, "s3": {"sfield3": {"a": True, "u2": 4, "u3": 3, "u4": 5}}}},
    ),
    (
        "object in array, array shrinks",
        {"field1": "abcd", "field2": [1, 2, 3, {"field3": ["largeString", 2, 3, 4, 5]}]},
        {"field1": "abcd", "field2": [1, 2, 3, {"field3": ["largeString", 2, 3, 5]}]},
        15,
        {"sfield2": {"a": True, "s3": {"sfield3": {"a": True, "l": 4, "u3": 5}}}},
    ),
    (
        "nested objects",
        {
            "level1Field1": "abcd",
            "level1Field2": {
                "level2Field1": {"level3Field1": {"p": 1}, "level3Field2": {"q": 1}},
                "level2Field2": 2,
            },
            "level1Field3": 3,
            "level1Field4": {"level2Field1": {"level3Field1": {"p": 1}, "level3Field2": {"q": 1}}},
        },
        {
            "level1Field1": "abcd",
            "level1Field2": {
                "level2Field1": {"level3Field1": {"q": 1}, "level3Field2": {"q": 1}},
                "level2Field2": 2,
            },
            "level1Field3": "3",
            "level1Field4": {"level2Field1": {"level3Field1": {"q": 1}, "level3Field2": {"q": 1}}},
        },
        15,
        {
            "u": {"level1Field3": "3"},
            "slevel1Field2": {"slevel2Field1": {"u": {"level3Field1": {"q": 1}}}},
            "slevel1Field4": {"slevel2Field1": {"u": {"level3Field1": {"q": 1}}}},
        },
    ),
    (
        "array in array, large delta",
        {"field1": "abcd", "field2": [1, 2, 3, {"field3": [2, 3, 4, 5]}]},
        {"field1": "abcd", "field2": [1, 2, 3, {"field3": [1, 2, 3, 4, 5]}]},
        15,
        {"sfield2": {"a": True, "u3": {"field3": [1, 2, 3, 4, 5]}}},
    ),
    (
        "object in array, large delta",
        {"field1": [1, 2, 3, 4, 5, 6, {"a": 1, "b": 2, "c": 3, "d": 4}, 7]},
        {"field1": [1, 2, 3, 4, 5, 6, {"p": 1, "q": 2}, 7]},
        0,
        {"sfield1": {"a": True, "u6": {"p": 1, "q": 2}}},
    ),
    (
        "object in object, large delta",
        {"field": {"p": "someString", "q": 2, "r": {"a": 1, "b": 2, "c": 3, "d": 4}, "s": 3}},
        {"field": {"p": "someString", "q": 2, "r": {"p": 1, "q": 2}, "s": 3}},
        0,
        {"sfield": {"u": {"r": {"p": 1, "q": 2}}}},
    ),
    (
        "array in object, large delta",
        {"field": {"p": "someString", "q": 2, "r": [1, 3, 4, 5], "s": 3}},
        {"field": {"p": "someString", "q": 2, "r": [1, 2, 3, 4], "s": 3}},
        0,
        {"sfield": {"u": {"r": [1, 2, 3, 4]}}},
    ),
]


def _bson(doc: dict[str, Any]) -> bytes:
    return bson.encode(doc)


@pytest.mark.parametrize(
    ("pre", "post", "padding", "expected"),
    [c[1:] for c in SERVER_CASES],
    ids=[c[0] for c in SERVER_CASES],
)
def test_server_cases(
    pre: dict[str, Any], post: dict[str, Any], padding: int, expected: dict[str, Any]
) -> None:
    kind, diff = diff_or_replacement(pre, post, padding=padding)
    assert kind == "diff"
    assert diff is not None
    assert _bson(diff) == _bson(expected)  # binary equality: field order and BSON types


@pytest.mark.parametrize(
    ("pre", "post", "padding"),
    [
        ({"a": 1, "b": 2, "c": 3}, {"A": 1, "B": 2, "C": 3}, 0),
        ({"b": 1, "c": 1, "d": 1}, {"a": 1, "b": 1, "c": 1, "d": 1}, 0),
        ({"b": 1}, {}, 0),
        ({"a": {"b": 1}}, {}, 0),
        ({"b": [1, 2, 3]}, {}, 0),
        ({"b": {}}, {}, 0),
        ({}, {"b": 1}, 0),
        ({}, {"a": {"b": 1}}, 0),
        ({}, {"b": [1, 2, 3]}, 0),
        ({"a": None}, {}, 15),
    ],
    ids=lambda value: repr(value),
)
def test_large_delta_logs_a_replacement(
    pre: dict[str, Any], post: dict[str, Any], padding: int
) -> None:
    assert diff_or_replacement(pre, post, padding=padding) == ("replace", None)


@pytest.mark.parametrize(
    "doc",
    [
        {"field1": 1},
        {"field1": []},
        {"field1": [{}]},
        {"field1": [0, 1, 2, 3, 4]},
        {"field1": None},
        {"0": [0]},
        {"0": [[{"0": [[{"0": [[]]}]]}]]},
        {},
    ],
)
def test_identical_documents_are_a_noop(doc: dict[str, Any]) -> None:
    assert diff_or_replacement(doc, doc) == ("noop", None)
    assert compute_diff(doc, doc) is None


@pytest.mark.parametrize(
    ("old", "new"),
    [(1, 1.0), (1, True), (1.0, True), (0, False), (1, Int64(1)), (0.0, -0.0), ("1", 1)],
    ids=repr,
)
def test_equality_is_type_aware(old: Any, new: Any) -> None:
    pre = {"_id": 1, "padding": "x" * 40, "v": old}
    post = {"_id": 1, "padding": "x" * 40, "v": new}
    diff = compute_diff(pre, post)
    assert diff is not None
    assert _bson(diff) == _bson({"u": {"v": new}})


def test_default_padding_is_the_delta_entry_metadata() -> None:
    # {u: {v: 2}} is 21 bytes; with 15 bytes of padding the approximate size
    # (15 + 5 + 8 + 1 + 2 + 4 = 35) exceeds the 27-byte post-image.
    pre, post = {"_id": 1, "v": 1}, {"_id": 1, "v": 2}
    assert DELTA_OPLOG_ENTRY_PADDING == 15
    assert diff_or_replacement(pre, post) == ("replace", None)
    assert diff_or_replacement(pre, post, padding=0) == ("diff", {"u": {"v": 2}})
    assert compute_diff(pre, post) is None


def test_spec_array_truncation() -> None:
    """change-streams.json "Test array truncation": a pipeline $set shortening an array."""
    pre = {"_id": 1, "a": 1, "array": ["foo", {"a": "bar"}, 1, 2, 3]}
    post = {"_id": 1, "a": 1, "array": ["foo", {"a": "bar"}]}
    diff = compute_diff(pre, post)
    assert diff == {"sarray": {"a": True, "l": 2}}
    description = update_description(
        diff, legacy=False, show_expanded_events=False, disambiguated_paths_supported=True
    )
    assert description == {
        "updatedFields": {},
        "removedFields": [],
        "truncatedArrays": [{"field": "array", "newSize": 2}],
    }
    assert list(description) == ["updatedFields", "removedFields", "truncatedArrays"]


def test_deeply_nested_delete() -> None:
    """DeepestObjectSubDiff-style: the diff follows the nesting down to the change."""
    depth = 20
    large = "a" * 50

    def nested(level: int, leaf: dict[str, Any]) -> dict[str, Any]:
        doc: dict[str, Any] = {"largeField": large}
        doc.update(leaf if level == depth - 1 else {"subObj": nested(level + 1, leaf)})
        return doc

    pre = nested(0, {"field": 1})
    post = nested(0, {"field": 2})
    diff = compute_diff(pre, post)
    expected: dict[str, Any] = {"u": {"field": 2}}
    for _ in range(depth - 1):
        expected = {"ssubObj": expected}
    assert diff == expected


def test_diff_does_not_share_containers_with_the_post_image() -> None:
    pre: dict[str, Any] = {"_id": 1, "padding": "x" * 40, "tags": ["a"], "meta": {"n": 1}}
    post: dict[str, Any] = {
        "_id": 1,
        "padding": "x" * 40,
        "tags": ["a", ["b"]],
        "meta": {"n": 1, "new": {"k": [1]}},
    }
    diff = compute_diff(pre, post)
    # meta's sub-diff would outgrow meta itself, so meta is an update of the whole object
    assert diff == {"u": {"meta": {"n": 1, "new": {"k": [1]}}}, "stags": {"a": True, "u1": ["b"]}}
    post["meta"]["new"]["k"].append(2)
    post["tags"][1].append("c")
    assert diff == {"u": {"meta": {"n": 1, "new": {"k": [1]}}}, "stags": {"a": True, "u1": ["b"]}}
