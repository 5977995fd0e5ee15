"""update_description: $v:2 diffs -> updateDescription (change_stream_document_diff_parser)."""

from __future__ import annotations

from typing import Any

import pytest

from changestream.testing.changestreams.update_description import update_description


def describe(diff: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "legacy": False,
        "show_expanded_events": True,
        "disambiguated_paths_supported": True,
    }
    options.update(kwargs)
    return update_description(diff, **options)


def test_spec_array_truncation() -> None:
    result = describe({"sarray": {"a": True, "l": 2}}, show_expanded_events=False)
    assert result == {
        "updatedFields": {},
        "removedFields": [],
        "truncatedArrays": [{"field": "array", "newSize": 2}],
    }


def test_spec_simple_set() -> None:
    """change-streams.json "Test insert, update, replace, and delete event types"."""
    result = describe({"u": {"x": 2}}, show_expanded_events=False)
    assert result == {"updatedFields": {"x": 2}, "removedFields": [], "truncatedArrays": []}


class TestSpecDisambiguatedPaths:
    """change-streams-disambiguatedPaths.json."""

    SET_A_1 = {"sa": {"u": {"1": 2}}}  # $set {"a.1": 2} on {a: {"1": 1}}

    def test_absent_without_show_expanded_events(self) -> None:
        result = describe(self.SET_A_1, show_expanded_events=False)
        assert "disambiguatedPaths" not in result
        assert set(result) == {"updatedFields", "removedFields", "truncatedArrays"}

    def test_absent_when_server_lacks_it(self) -> None:
        result = describe(self.SET_A_1, disambiguated_paths_supported=False)
        assert "disambiguatedPaths" not in result

    def test_present_for_ambiguous_path(self) -> None:
        result = describe(self.SET_A_1)
        assert result["updatedFields"] == {"a.1": 2}
        assert result["disambiguatedPaths"] == {"a.1": ["a", "1"]}

    def test_array_indices_are_integers(self) -> None:
        # $set {"a.0.1": 2} on {a: [{"1": 1}]}
        result = describe({"sa": {"a": True, "s0": {"u": {"1": 2}}}})
        assert result["updatedFields"] == {"a.0.1": 2}
        path = result["disambiguatedPaths"]["a.0.1"]
        assert path == ["a", 0, "1"]
        assert [type(part) for part in path] == [str, int, str]


# Cases from mongod's change_stream_document_diff_parser_test.cpp.


def test_disambiguates_dotted_fields() -> None:
    diff = {
        "u": {"a.b": 1},
        "sc.d.": {"u": {"e": 1, "f.g": 1}, "sh": {"u": {"i.j": 1}}},
        "sk": {"u": {"l.m": 1}},
    }
    result = describe(diff)
    assert result["updatedFields"] == {
        "a.b": 1,
        "c.d..e": 1,
        "c.d..f.g": 1,
        "c.d..h.i.j": 1,
        "k.l.m": 1,
    }
    assert list(result["updatedFields"]) == ["a.b", "c.d..e", "c.d..f.g", "c.d..h.i.j", "k.l.m"]
    assert result["disambiguatedPaths"] == {
        "a.b": ["a.b"],
        "c.d..e": ["c.d.", "e"],
        "c.d..f.g": ["c.d.", "f.g"],
        "c.d..h.i.j": ["c.d.", "h", "i.j"],
        "k.l.m": ["k", "l.m"],
    }
    assert result["removedFields"] == []
    assert result["truncatedArrays"] == []


def test_disambiguates_numeric_fields() -> None:
    result = describe({"sa": {"u": {"0": 1}}})
    assert result["updatedFields"] == {"a.0": 1}
    assert result["disambiguatedPaths"] == {"a.0": ["a", "0"]}


def test_disambiguates_numeric_fields_from_array_indices() -> None:
    result = describe({"sa": {"s0": {"a": True, "u0": 1}}})
    assert result["updatedFields"] == {"a.0.0": 1}
    assert result["disambiguatedPaths"] == {"a.0.0": ["a", "0", 0]}


@pytest.mark.parametrize(
    ("diff", "updated"),
    [
        ({"u": {"0": 1}}, {"0": 1}),  # numeric at the root is a field name
        ({"sa": {"u": {"01": 1}}}, {"a.01": 1}),  # leading zero: not an array index
        ({"sa": {"a": True, "s0": {"u": {"b": 1}}}}, {"a.0.b": 1}),  # indices alone
    ],
)
def test_unambiguous_paths(diff: dict[str, Any], updated: dict[str, Any]) -> None:
    result = describe(diff)
    assert result["updatedFields"] == updated
    assert result["disambiguatedPaths"] == {}


def test_disambiguates_removed_fields() -> None:
    result = describe({"d": {"a.b": False}, "sc": {"d": {"0": False}}})
    assert result["removedFields"] == ["a.b", "c.0"]
    assert result["disambiguatedPaths"] == {"a.b": ["a.b"], "c.0": ["c", "0"]}
    assert result["updatedFields"] == {}


def test_disambiguates_truncated_arrays() -> None:
    result = describe({"sa.b": {"a": True, "l": 5}, "sc": {"s0": {"a": True, "l": 5}}})
    assert result["truncatedArrays"] == [
        {"field": "a.b", "newSize": 5},
        {"field": "c.0", "newSize": 5},
    ]
    assert result["disambiguatedPaths"] == {"a.b": ["a.b"], "c.0": ["c", "0"]}


def test_disambiguates_combination_of_ambiguous_fields() -> None:
    diff = {
        "sa.b": {"a": True, "s0": {"u": {"1": 1}}},
        "sc": {"a": True, "s0": {"u": {"d.e": 1}}, "s1": {"u": {"2": 1}}},
        "sf": {"s1": {"u": {"g.h": 1}, "s2": {"a": True, "u3": 1, "s4": {"u": {"5": 1}}}}},
    }
    result = describe(diff)
    assert list(result["updatedFields"]) == [
        "a.b.0.1",
        "c.0.d.e",
        "c.1.2",
        "f.1.g.h",
        "f.1.2.3",
        "f.1.2.4.5",
    ]
    assert result["disambiguatedPaths"] == {
        "a.b.0.1": ["a.b", 0, "1"],
        "c.0.d.e": ["c", 0, "d.e"],
        "c.1.2": ["c", 1, "2"],
        "f.1.g.h": ["f", "1", "g.h"],
        "f.1.2.3": ["f", "1", "2", 3],
        "f.1.2.4.5": ["f", "1", "2", 4, "5"],
    }


def test_section_order_and_key_order() -> None:
    """u, then i, then b entries, then d, then sub-diffs, whatever the diff's key order."""
    diff = {
        "d": {"gone": False},
        "u": {"x": 1},
        "i": {"new": {"k": 1}},
        "sobj": {"u": {"y": 2}, "d": {"z": False}},
        "sarr": {"a": True, "l": 3, "u1": "v", "s2": {"u": {"w": 3}}},
    }
    result = describe(diff, show_expanded_events=False)
    assert list(result) == ["updatedFields", "removedFields", "truncatedArrays"]
    assert list(result["updatedFields"].items()) == [
        ("x", 1),
        ("new", {"k": 1}),
        ("obj.y", 2),
        ("arr.1", "v"),
        ("arr.2.w", 3),
    ]
    assert result["removedFields"] == ["gone", "obj.z"]
    assert result["truncatedArrays"] == [{"field": "arr", "newSize": 3}]

    expanded = describe(diff)
    assert list(expanded) == [
        "updatedFields",
        "removedFields",
        "truncatedArrays",
        "disambiguatedPaths",
    ]
    assert expanded["disambiguatedPaths"] == {}


def test_arrays_of_objects() -> None:
    diff = {
        "sitems": {
            "a": True,
            "s0": {"u": {"qty": 5}},
            "u2": {"sku": "b"},
            "s3": {"d": {"x": False}},
        }
    }
    result = describe(diff)
    assert result["updatedFields"] == {"items.0.qty": 5, "items.2": {"sku": "b"}}
    assert result["removedFields"] == ["items.3.x"]
    assert result["disambiguatedPaths"] == {}


class TestLegacy:
    """4.2/4.4: {updatedFields, removedFields} only; resized arrays are reported whole."""

    def test_only_two_fields(self) -> None:
        result = describe({"u": {"a": 1}, "d": {"b": False}}, legacy=True)
        assert result == {"updatedFields": {"a": 1}, "removedFields": ["b"]}
        assert list(result) == ["updatedFields", "removedFields"]

    def test_resized_array_comes_from_the_post_image(self) -> None:
        post = {"_id": 1, "a": 1, "array": ["foo", {"a": "bar"}]}
        result = describe({"sarray": {"a": True, "l": 2}}, legacy=True, post_image=post)
        assert result == {"updatedFields": {"array": ["foo", {"a": "bar"}]}, "removedFields": []}

    def test_resize_replaces_the_array_entries(self) -> None:
        post = {"doc": {"list": [{"n": 9}, 2]}}
        diff = {"sdoc": {"slist": {"a": True, "l": 2, "s0": {"u": {"n": 9}}}}}
        result = describe(diff, legacy=True, post_image=post)
        assert result["updatedFields"] == {"doc.list": [{"n": 9}, 2]}

    def test_resize_inside_an_array_element(self) -> None:
        post = {"m": [[1], [2, 3]]}
        result = describe(
            {"sm": {"a": True, "s1": {"a": True, "l": 2}}}, legacy=True, post_image=post
        )
        assert result["updatedFields"] == {"m.1": [2, 3]}

    def test_array_updates_without_resize_stay_dotted(self) -> None:
        result = describe({"sarr": {"a": True, "u3": "x"}}, legacy=True)
        assert result["updatedFields"] == {"arr.3": "x"}

    def test_no_disambiguated_paths_even_when_requested(self) -> None:
        result = describe({"sa": {"u": {"1": 2}}}, legacy=True)
        assert "disambiguatedPaths" not in result

    def test_resize_without_post_image_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="post-image"):
            describe({"sarray": {"a": True, "l": 2}}, legacy=True)

    def test_resize_missing_from_post_image_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="'array' is missing"):
            describe({"sarray": {"a": True, "l": 2}}, legacy=True, post_image={"_id": 1})


@pytest.mark.parametrize(
    "diff",
    [
        {"x": {"a": 1}},  # unknown section
        {"sarr": {"a": True, "x1": 2}},  # unknown array entry
        {"sarr": {"a": True, "uX": 2}},  # non-numeric index
        {"sobj": {}},  # empty sub-diff
    ],
)
def test_malformed_diffs_are_rejected(diff: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="malformed update diff"):
        describe(diff)
