"""The unified format's "Evaluating Matches" rules.

Expected values are documents, arrays or scalars that may contain special
``$$`` operators. Root-level documents may carry extra keys, nested ones may
not; arrays must have the same length; int, long and double compare by value.
A mismatch raises :class:`MatchError` naming the path of the first difference.
"""

from __future__ import annotations

import datetime
import re
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from bson import json_util
from bson.binary import Binary, UuidRepresentation
from bson.code import Code
from bson.dbref import DBRef
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.regex import Regex
from bson.timestamp import Timestamp

from . import RunnerError, SpecFailure


class MatchError(SpecFailure):
    """Expected and actual values differ."""


class EntityLookup(Protocol):
    """What ``$$matchesEntity`` and ``$$sessionLsid`` need from the entity map."""

    def bson_entity(self, name: str) -> Any: ...

    def session_lsid(self, name: str) -> Mapping[str, Any]: ...


_NUMERIC = frozenset({"int", "long", "double"})
_TYPE_ALIASES = {"number": frozenset({"int", "long", "double", "decimal"})}
KNOWN_TYPES = frozenset(
    {
        "double",
        "string",
        "object",
        "array",
        "binData",
        "undefined",
        "objectId",
        "bool",
        "date",
        "null",
        "regex",
        "dbPointer",
        "javascript",
        "symbol",
        "javascriptWithScope",
        "int",
        "timestamp",
        "long",
        "decimal",
        "minKey",
        "maxKey",
    }
)


def bson_type(value: Any) -> str:
    """The ``$type`` name of a decoded BSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, Int64):
        return "long"
    if isinstance(value, int):
        return "int" if -(2**31) <= value < 2**31 else "long"
    if isinstance(value, float):
        return "double"
    if isinstance(value, Decimal128):
        return "decimal"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (Mapping, DBRef)):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, (bytes, uuid.UUID)):
        return "binData"
    if isinstance(value, ObjectId):
        return "objectId"
    if isinstance(value, datetime.datetime):
        return "date"
    if isinstance(value, (Regex, re.Pattern)):
        return "regex"
    if isinstance(value, Code):
        return "javascript" if value.scope is None else "javascriptWithScope"
    if isinstance(value, Timestamp):
        return "timestamp"
    if isinstance(value, MinKey):
        return "minKey"
    if isinstance(value, MaxKey):
        return "maxKey"
    raise RunnerError(f"cannot tell the BSON type of {type(value).__name__} value {value!r}")


def _is_operator(value: Any) -> bool:
    return isinstance(value, Mapping) and len(value) == 1 and next(iter(value)).startswith("$$")


def _normalize_scalar(value: Any, kind: str) -> Any:
    """Make equal BSON values compare equal in Python."""
    if kind == "binData":
        if isinstance(value, uuid.UUID):
            return 4, Binary.from_uuid(value, UuidRepresentation.STANDARD)
        if isinstance(value, Binary):
            return value.subtype, bytes(value)
        return 0, bytes(value)
    if kind == "date":
        if value.tzinfo is not None:
            value = value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
        return value.replace(microsecond=value.microsecond // 1000 * 1000)
    if kind == "regex":
        if isinstance(value, re.Pattern):
            value = Regex.from_native(value)
        return value.pattern, value.flags
    if kind in ("object", "javascriptWithScope") and isinstance(value, RawBSONDocument):
        return dict(value)
    return value


def values_equal(expected: Any, actual: Any) -> bool:
    """Scalar equality with flexible numerics (int/long/double; not decimal, not bool)."""
    exp_kind, act_kind = bson_type(expected), bson_type(actual)
    if exp_kind in _NUMERIC and act_kind in _NUMERIC:
        return bool(expected == actual)
    if exp_kind != act_kind:
        return False
    return bool(_normalize_scalar(expected, exp_kind) == _normalize_scalar(actual, act_kind))


def _show(value: Any) -> str:
    try:
        text = json_util.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 300 else text[:297] + "..."


def match(
    expected: Any,
    actual: Any,
    *,
    root: bool = True,
    entities: EntityLookup | None = None,
    path: str = "$",
) -> None:
    """Assert that ``actual`` matches ``expected``; raise :class:`MatchError` if not."""
    _Matcher(entities).match(expected, actual, root, path)


class _Matcher:
    def __init__(self, entities: EntityLookup | None) -> None:
        self.entities = entities

    def fail(self, path: str, message: str) -> MatchError:
        return MatchError(f"at {path}: {message}")

    def match(self, expected: Any, actual: Any, root: bool, path: str) -> None:
        if isinstance(actual, RawBSONDocument):
            actual = _decode_raw(actual)
        if isinstance(expected, Mapping):
            if _is_operator(expected):
                self.operator(expected, actual, root, path)
                return
            self.document(expected, actual, root, path)
            return
        if isinstance(expected, (list, tuple)):
            self.array(expected, actual, path)
            return
        if isinstance(actual, (Mapping, list, tuple)):
            raise self.fail(path, f"expected {_show(expected)}, got {_show(actual)}")
        if not values_equal(expected, actual):
            raise self.fail(
                path,
                f"expected {bson_type(expected)} {_show(expected)}, "
                f"got {bson_type(actual)} {_show(actual)}",
            )

    def document(self, expected: Mapping[str, Any], actual: Any, root: bool, path: str) -> None:
        if not isinstance(actual, Mapping):
            raise self.fail(path, f"expected a document, got {_show(actual)}")
        for key, value in expected.items():
            self.key_value(value, key, actual, f"{path}.{key}")
        if not root:
            extra = [k for k in actual if k not in expected]
            if extra:
                raise self.fail(
                    path, f"unexpected keys {extra} in a nested document {_show(actual)}"
                )

    def key_value(self, value: Any, key: str, actual: Mapping[str, Any], path: str) -> None:
        """Match one expected key; $$exists and $$unsetOrMatches look at its presence."""
        if _is_operator(value):
            op, arg = next(iter(value.items()))
            if op == "$$exists":
                if not isinstance(arg, bool):
                    raise RunnerError(f"$$exists needs a boolean at {path}")
                if arg and key not in actual:
                    raise self.fail(path, "key is missing (expected $$exists: true)")
                if not arg and key in actual:
                    raise self.fail(
                        path, f"key is present with {_show(actual[key])} (expected $$exists: false)"
                    )
                return
            if op == "$$unsetOrMatches":
                if key in actual:
                    self.key_value(arg, key, actual, path)
                return
        if key not in actual:
            raise self.fail(path, f"key is missing (expected {_show(value)})")
        self.match(value, actual[key], False, path)

    def array(self, expected: list[Any] | tuple[Any, ...], actual: Any, path: str) -> None:
        if not isinstance(actual, (list, tuple)):
            raise self.fail(path, f"expected an array, got {_show(actual)}")
        if len(expected) != len(actual):
            raise self.fail(
                path, f"expected {len(expected)} elements, got {len(actual)}: {_show(actual)}"
            )
        for index, (exp, act) in enumerate(zip(expected, actual, strict=True)):
            self.match(exp, act, False, f"{path}[{index}]")

    def operator(self, expected: Mapping[str, Any], actual: Any, root: bool, path: str) -> None:
        op, arg = next(iter(expected.items()))
        if op == "$$type":
            self.type_(arg, actual, path)
        elif op == "$$unsetOrMatches":
            if actual is not None:
                self.match(arg, actual, root, path)
        elif op == "$$exists":
            raise RunnerError(f"$$exists must be the value of a document key (at {path})")
        elif op == "$$matchesEntity":
            self.match(self._entities(op).bson_entity(arg), actual, root, path)
        elif op == "$$sessionLsid":
            lsid = self._entities(op).session_lsid(arg)
            self.match(dict(lsid), actual, False, path)
        elif op == "$$matchesHexBytes":
            self.hex_bytes(arg, actual, path)
        elif op == "$$lte":
            if bson_type(arg) not in _NUMERIC or bson_type(actual) not in _NUMERIC:
                raise self.fail(path, f"$$lte needs numbers, got {_show(actual)} <= {_show(arg)}")
            if not actual <= arg:
                raise self.fail(path, f"expected <= {_show(arg)}, got {_show(actual)}")
        elif op == "$$matchAsDocument":
            if not isinstance(actual, str):
                raise self.fail(
                    path, f"$$matchAsDocument needs an Extended JSON string, got {_show(actual)}"
                )
            try:
                parsed = json_util.loads(actual)
            except ValueError as exc:
                raise self.fail(path, f"not Extended JSON: {exc}") from exc
            self.match(arg, parsed, False, path)
        elif op == "$$matchAsRoot":
            self.match(arg, actual, True, path)
        else:
            raise RunnerError(f"unsupported special operator {op} (at {path})")

    def type_(self, names: Any, actual: Any, path: str) -> None:
        wanted: set[str] = set()
        for name in [names] if isinstance(names, str) else list(names):
            if name in _TYPE_ALIASES:
                wanted |= _TYPE_ALIASES[name]
            elif name in KNOWN_TYPES:
                wanted.add(name)
            else:
                raise RunnerError(f"unknown $$type {name!r} (at {path})")
        kind = bson_type(actual)
        if kind not in wanted:
            raise self.fail(path, f"expected type {names}, got {kind} {_show(actual)}")

    def hex_bytes(self, hexstr: Any, actual: Any, path: str) -> None:
        if (
            not isinstance(hexstr, str)
            or len(hexstr) % 2
            or re.fullmatch(r"[0-9a-fA-F]*", hexstr) is None
        ):
            raise RunnerError(f"malformed $$matchesHexBytes {hexstr!r} (at {path})")
        if not isinstance(actual, bytes):
            raise self.fail(path, f"expected bytes, got {_show(actual)}")
        if bytes(actual).hex() != hexstr.lower():
            raise self.fail(path, f"expected bytes {hexstr.lower()}, got {bytes(actual).hex()}")

    def _entities(self, op: str) -> EntityLookup:
        if self.entities is None:
            raise RunnerError(f"{op} used where no entity map is available")
        return self.entities


def _decode_raw(doc: RawBSONDocument) -> dict[str, Any]:
    from bson import decode

    return decode(doc.raw)
