"""Unit tests of the resume-token helpers (Extended JSON storage, cluster time)."""

from __future__ import annotations

import json
from typing import Any

import bson
import pytest
from bson.binary import Binary
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp

from changestream import token_cluster_time, token_from_json, token_to_json

# Real tokens from the server notes (v1 insert from a 4.4 server; v2 insert; v2 HWM).
V1_INSERT = (
    "82612E8513000000012B022C0100296E5A1004A5093ABB38FE4B9EA67F01BB1A96D812463C5F6964003C5F5F5F78"
    "000004"
)
V2_HWM = "826553F100000000042B0429296E1404"


def test_json_round_trip_keeps_type_bits_byte_for_byte() -> None:
    original = {"_data": V1_INSERT, "_typeBits": Binary(b"\x82\x00\x01", 0)}
    for canonical in (False, True):
        text = token_to_json(original, canonical=canonical)
        assert json.loads(text)["_typeBits"] == {"$binary": {"base64": "ggAB", "subType": "00"}}
        assert bson.encode(token_from_json(text)) == bson.encode(original)


def test_raw_token_serialises_like_its_dict() -> None:
    raw = RawBSONDocument(bson.encode({"_data": V2_HWM}))
    assert token_from_json(token_to_json(raw)) == {"_data": V2_HWM}
    assert token_from_json(token_to_json(raw).encode()) == {"_data": V2_HWM}


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"x": 1}', "42"])
def test_from_json_rejects_non_tokens(text: str) -> None:
    with pytest.raises(ValueError, match="resume token"):
        token_from_json(text)


def test_to_json_rejects_non_documents() -> None:
    with pytest.raises(TypeError, match="token must be a document"):
        token_to_json("826553")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ({"_data": V1_INSERT}, Timestamp(1630438675, 1)),
        ({"_data": V2_HWM}, Timestamp(1700000000, 4)),
        ({"_data": V2_HWM.lower()}, Timestamp(1700000000, 4)),
        ({"_data": Binary(bytes.fromhex("825DD28AD000000005463C"), 0)}, Timestamp(1574079184, 5)),
        (RawBSONDocument(bson.encode({"_data": V2_HWM})), Timestamp(1700000000, 4)),
    ],
)
def test_cluster_time_from_the_keystring_prefix(token: Any, expected: Timestamp) -> None:
    assert token_cluster_time(token) == expected


@pytest.mark.parametrize(
    "token",
    [{"_data": "2B02"}, {"_data": "82ABCD"}, {"_data": "zz" * 9}, {"_data": 5}, {}, {"x": 1},
     "82612E851300000001"],
)
def test_cluster_time_is_none_when_undecodable(token: Any) -> None:
    assert token_cluster_time(token) is None


# -- ResumeToken: the one internal type ---------------------------------------------------------
def test_resume_token_equality_and_hash_are_by_bson_bytes_whatever_the_mapping() -> None:
    from bson.son import SON

    from changestream._token import ResumeToken

    plain = {"_data": V2_HWM}
    forms = [plain, SON(plain), RawBSONDocument(bson.encode(plain)), token_from_json(token_to_json(plain))]
    tokens = {ResumeToken.of(form) for form in forms}
    assert len(tokens) == 1
    with_type_bits = ResumeToken.of({"_data": V2_HWM, "_typeBits": Binary(b"\x01", 0)})
    assert with_type_bits != ResumeToken.of(plain)
    assert ResumeToken.of(plain) != plain  # a token is not a mapping: no accidental equality


def test_resume_token_orders_by_keystring_bytes_and_reads_cluster_time() -> None:
    from changestream._token import ResumeToken

    older = ResumeToken.of({"_data": "82" + "00000001" + "00000005" + "04"})
    newer = ResumeToken.of({"_data": "82" + "00000002" + "00000001" + "04"})
    lower_case = ResumeToken.of({"_data": ("82" + "00000002" + "00000001" + "04").lower()})
    assert older < newer and newer > older and older <= older and newer >= lower_case >= newer
    assert sorted([newer, older]) == [older, newer]
    assert newer.cluster_time == Timestamp(2, 1)
    assert ResumeToken.of({"_data": V1_INSERT}).cluster_time == token_cluster_time({"_data": V1_INSERT})
    assert ResumeToken.of({"_data": Binary(bytes.fromhex(V2_HWM), 0)}).cluster_time == (
        token_cluster_time({"_data": V2_HWM})
    )
    assert ResumeToken.of({"_data": 5}).cluster_time is None


def test_resume_token_json_round_trip_and_documents() -> None:
    from changestream._token import ResumeToken

    original = {"_data": V1_INSERT, "_typeBits": Binary(b"\x82\x00\x01", 0)}
    token = ResumeToken.of(original)
    assert ResumeToken.from_json(token.to_json()) == token
    assert ResumeToken.from_json(token.to_json(canonical=True)) == token
    assert bson.encode(token.document()) == bson.encode(original)
    assert token.data == V1_INSERT


def test_resume_token_rejects_what_is_not_a_token() -> None:
    from changestream._token import ResumeToken

    with pytest.raises(TypeError, match="mapping"):
        ResumeToken.of("82AB")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="_data"):
        ResumeToken.of({"x": 1})
    with pytest.raises(ValueError, match="resume token"):
        ResumeToken.from_json('{"x": 1}')
    assert ResumeToken.maybe(None) is None
    assert ResumeToken.maybe({"x": 1}) == ResumeToken.maybe({"x": 1})  # comparable, unchecked


def test_resume_token_present_gives_the_users_mapping() -> None:
    from bson.codec_options import CodecOptions
    from bson.son import SON

    from changestream._token import ResumeToken

    raw = RawBSONDocument(bson.encode({"_data": V2_HWM}))
    assert ResumeToken.present(raw, CodecOptions(document_class=RawBSONDocument)) is raw
    assert ResumeToken.present(raw, CodecOptions()) == {"_data": V2_HWM}
    plain = {"_data": V2_HWM}
    copy = ResumeToken.present(plain, CodecOptions())
    assert copy == plain and copy is not plain
    son = SON([("_data", V2_HWM)])
    assert type(ResumeToken.present(son, CodecOptions(document_class=SON))) is SON
    assert ResumeToken.present(None, CodecOptions()) is None


def test_token_in_raw_event_reads_bytes_and_memoryviews() -> None:
    """PyMongo hands the events of large (split-event) replies over as memoryviews."""
    from changestream._token import token_in_raw_event

    event = bson.encode({"_id": {"_data": V2_HWM}, "operationType": "insert"})
    assert token_in_raw_event(event)
    assert token_in_raw_event(memoryview(event))
    assert not token_in_raw_event(bson.encode({"_id": V2_HWM, "operationType": "insert"}))
    assert not token_in_raw_event(bson.encode({"_id": {"x": V2_HWM}, "operationType": "insert"}))
    cut = bytearray(event)
    cut[9] = 200  # _id claims to run past the event
    assert not token_in_raw_event(bytes(cut))
