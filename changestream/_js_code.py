"""JavaScript code values (BSON types 0x0D, 0x0F) for the fast JSON encoders.

They decode to :class:`~bson.code.Code`, a ``str`` subclass, which the ``json``
module's C encoder writes as a plain string where ``json_util`` writes
``{"$code": ...}`` (and ``"$scope"``). Decoded with :data:`HOLDING`, each is a
:class:`JsCode` instead, which the C encoder hands to its ``default`` (there:
:func:`code_json`); values decoded elsewhere are searched with :func:`holds_code`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any, cast

import bson
from bson.code import Code
from bson.codec_options import CodecOptions, TypeDecoder, TypeRegistry
from bson.int64 import Int64
from bson.objectid import ObjectId

__all__ = [
    "HOLDING", "PLAIN", "JsCode", "code_held", "code_json", "decode_all_held", "decode_held",
    "held", "holds_code", "may_hold_code", "unmarked",
]


class JsCode:
    """A JavaScript code value, held so that the C encoder hands it to ``default``."""

    __slots__ = ("code",)

    def __init__(self, code: Code) -> None:
        self.code = code

    def __repr__(self) -> str:
        return repr(self.code)


class _HoldCode(TypeDecoder):
    bson_type = Code

    def transform_bson(self, value: Any) -> Any:
        return JsCode(value)


PLAIN: CodecOptions[dict[str, Any]] = CodecOptions(document_class=dict)
HOLDING: CodecOptions[dict[str, Any]] = PLAIN.with_options(
    type_registry=TypeRegistry([_HoldCode()]))
"""``PLAIN`` with code held as :class:`JsCode` (decoding with the hook costs ~12% more)."""


def may_hold_code(raw: bytes) -> bool:
    """False when BSON bytes cannot hold code: neither type byte occurs in them at all
    (in three quarters of the benchmark's orders)."""
    return b"\r" in raw or b"\x0f" in raw


def code_json(value: JsCode) -> dict[str, Any]:
    """What ``json_util`` writes for the held code (relaxed and canonical alike)."""
    code = value.code
    if code.scope is None:
        return {"$code": str(code)}
    return {"$code": str(code), "$scope": code.scope}


def unmarked(value: Any) -> Any:
    """A decoded value with its :class:`JsCode` back to ``Code``, for ``json_util``."""
    kind = type(value)
    if kind is JsCode:
        code = value.code
        return code if code.scope is None else Code(str(code), unmarked(code.scope))
    if kind is dict:
        return {key: unmarked(item) for key, item in value.items()}
    if kind is list:
        return [unmarked(item) for item in value]
    return value


def holds_code(value: Any) -> bool:
    """Whether a decoded value is or holds a ``Code`` (which the C encoder would write
    as a plain string)."""
    kind = type(value)
    if kind is dict:
        items: Any = value.values()
    elif kind is list:
        items = value
    elif kind in _LEAVES:
        return False
    elif isinstance(value, Code):
        return True
    elif isinstance(value, Mapping):
        items = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return False
    for item in items:  # noqa: SIM110 (a loop: a generator per container cost twice the walk)
        if type(item) not in _LEAVES and holds_code(item):
            return True
    return False


def held(value: Any) -> Any:
    """A decoded value with each ``Code`` held as :class:`JsCode` (values that hold one)."""
    if isinstance(value, Code):
        return JsCode(value if value.scope is None else Code(str(value), held(value.scope)))
    if isinstance(value, Mapping):
        return {key: held(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [held(item) for item in value]
    return value


_LEAVES = frozenset({str, int, Int64, float, bool, type(None), ObjectId, datetime.datetime})
"""Types that hold no ``Code`` (the walk steps over them)."""


_decode: Any = getattr(bson, "_bson_to_dict", bson.decode)  # bson.decode less its checks


def decode_held(raw: bytes | memoryview) -> dict[str, Any]:
    """A BSON document's bytes decoded, code held (when the bytes may hold any)."""
    if type(raw) is not bytes:
        raw = bytes(raw)
    return cast("dict[str, Any]", _decode(raw, HOLDING if may_hold_code(raw) else PLAIN))


def decode_all_held(data: bytes) -> list[Mapping[str, Any]]:
    """BSON documents back to back, decoded in one call, code held (when the bytes may
    hold any)."""
    return cast("list[Mapping[str, Any]]",
                bson.decode_all(data, HOLDING if may_hold_code(data) else PLAIN))


def code_held(value: Any) -> Any:
    """A document decoded elsewhere with its code held (itself when it holds none)."""
    return held(value) if holds_code(value) else value
