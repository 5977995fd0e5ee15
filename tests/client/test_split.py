"""Unit tests of split-event reassembly ($changeStreamSplitLargeEvent)."""

from __future__ import annotations

from typing import Any

import bson
import pytest
from bson.raw_bson import RawBSONDocument

from changestream._split import SplitReassembler, split_position
from changestream.errors import SplitEventError


def fragment(i: int, of: int, **fields: Any) -> dict[str, Any]:
    return {"_id": {"_data": f"T{i}"}, "splitEvent": {"fragment": i, "of": of}, **fields}


def test_unsplit_events_pass_through_unchanged() -> None:
    reassembler = SplitReassembler()
    event = {"_id": {"_data": "X"}, "operationType": "insert"}
    assert reassembler.add(event) is event
    assert not reassembler.pending


def test_merge_keeps_last_id_and_field_order_and_drops_split_event() -> None:
    reassembler = SplitReassembler()
    assert reassembler.add(fragment(1, 3, operationType="update", ns={"db": "d"})) is None
    assert reassembler.pending
    assert reassembler.add(fragment(2, 3, fullDocument={"v": "x"})) is None
    merged = reassembler.add(fragment(3, 3, fullDocumentBeforeChange={"v": "y"}))
    assert merged is not None
    assert list(merged) == ["_id", "operationType", "ns", "fullDocument", "fullDocumentBeforeChange"]
    assert merged["_id"] == {"_data": "T3"}
    assert not reassembler.pending


def test_raw_fragments_merge_and_encode() -> None:
    reassembler = SplitReassembler()
    first = RawBSONDocument(bson.encode(fragment(1, 2, operationType="update", a={"n": 1})))
    second = RawBSONDocument(bson.encode(fragment(2, 2, b=[1, 2])))
    assert reassembler.add(first) is None
    merged = reassembler.add(second)
    assert merged is not None
    assert bson.decode(bson.encode(merged)) == {
        "_id": {"_data": "T2"}, "operationType": "update", "a": {"n": 1}, "b": [1, 2],
    }


def test_single_fragment_run_is_complete() -> None:
    assert SplitReassembler().add(fragment(1, 1, x=1)) == {"_id": {"_data": "T1"}, "x": 1}


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([fragment(2, 2)], "expected fragment 1 of 2, got fragment 2 of 2"),
        ([fragment(1, 3), fragment(3, 3)], "expected fragment 2 of 3, got fragment 3 of 3"),
        ([fragment(1, 3), fragment(1, 3)], "expected fragment 2 of 3, got fragment 1 of 3"),
        ([fragment(1, 3), fragment(2, 2)], "expected fragment 2 of 3, got fragment 2 of 2"),
        ([fragment(1, 2), {"_id": 1, "operationType": "insert"}], "got an unsplit event"),
    ],
)
def test_gaps_repeats_and_changed_counts_are_one_clear_error(
    events: list[dict[str, Any]], message: str
) -> None:
    reassembler = SplitReassembler()
    with pytest.raises(SplitEventError, match=message):
        for event in events:
            reassembler.add(event)
    assert not reassembler.pending


def test_reset_forgets_an_incomplete_run() -> None:
    reassembler = SplitReassembler()
    reassembler.add(fragment(1, 2, a=1))
    reassembler.reset()
    assert reassembler.add(fragment(1, 2, a=2)) is None
    assert reassembler.add(fragment(2, 2)) == {"_id": {"_data": "T2"}, "a": 2}


@pytest.mark.parametrize(
    "split",
    [{"fragment": 0, "of": 2}, {"fragment": 3, "of": 2}, {"fragment": "1", "of": 2}, {"of": 2},
     "1/2", {"fragment": True, "of": 1}],
)
def test_malformed_split_field(split: Any) -> None:
    with pytest.raises(SplitEventError, match="malformed splitEvent"):
        split_position({"_id": 1, "splitEvent": split})
