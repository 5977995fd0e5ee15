"""Parsing operator updates into mongod's update tree (``update_object_node.cpp``).

The paths of all modifiers are merged into one tree whose children are later
applied in field-name order; conflicting paths, bad operands and bad array
filters fail here with mongod's errors. Also the numeric helpers the
modifiers share.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from bson.decimal128 import Decimal128, create_decimal128_context
from bson.int64 import Int64
from bson.timestamp import Timestamp

from ..core.errors import CommandError
from ..storage import (
    bson_repr,
    type_name,
    values_equal,
)

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_DEC_CTX = create_decimal128_context()
_MISSING: Any = object()
"""What an expression that yields nothing evaluates to."""
_FILTER_ID = re.compile(r"^[a-z][a-zA-Z0-9]*$")

_MODIFIERS = (
    "$set",
    "$unset",
    "$inc",
    "$mul",
    "$min",
    "$max",
    "$rename",
    "$setOnInsert",
    "$currentDate",
    "$push",
    "$addToSet",
    "$pop",
    "$pull",
    "$pullAll",
    "$bit",
)
_NO_CREATE = frozenset({"$unset", "$pop", "$pull", "$pullAll", "$placeholder"})
"""Modifiers that do nothing on a missing path (mongod's ``allowCreation() == false``)."""


@dataclass(frozen=True, slots=True)
class UpdateEnv:
    """What an update may need from the server: the current date and timestamp."""

    now: Callable[[], datetime]
    timestamp: Callable[[], Timestamp]


@dataclass(slots=True)
class Outcome:
    """The result of applying an update to one document.

    ``oplog_o`` is None for a no-op (nothing logged); otherwise it is either
    ``{"$v": 2, "diff": ...}`` or, when ``replacement`` is true, the whole new
    document.
    """

    doc: dict[str, Any]
    oplog_o: dict[str, Any] | None
    replacement: bool = False


# ======================================================================================
# Numbers (mongod's SafeNum)
# ======================================================================================


def _num_rank(value: Any) -> int:
    """1 int32, 2 int64, 3 double, 4 decimal; 0 not a number."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, Int64):
        return 2
    if isinstance(value, int):
        return 1 if _INT32_MIN <= value <= _INT32_MAX else 2
    if isinstance(value, float):
        return 3
    if isinstance(value, Decimal128):
        return 4
    return 0


def _to_decimal(value: Any) -> Decimal:
    return value.to_decimal() if isinstance(value, Decimal128) else Decimal(value)


def _arith(op: str, current: Any, operand: Any, id_text: str) -> Any:
    """``current (op) operand`` with mongod's type promotion (int32 overflows to int64)."""
    rank = max(_num_rank(current), _num_rank(operand))
    if rank == 4:
        a, b = _to_decimal(current), _to_decimal(operand)
        return Decimal128(_DEC_CTX.add(a, b) if op == "$inc" else _DEC_CTX.multiply(a, b))
    if rank == 3:
        return float(current) + float(operand) if op == "$inc" else float(current) * float(operand)
    result = int(current) + int(operand) if op == "$inc" else int(current) * int(operand)
    if rank == 1 and _INT32_MIN <= result <= _INT32_MAX:
        return result
    if _INT64_MIN <= result <= _INT64_MAX:
        return Int64(result)
    shown = f"(NumberLong){int(current)}" if _num_rank(current) == 2 else f"(NumberInt){current}"
    raise CommandError(
        2,
        f"Failed to apply {op} operations to current value ({shown}) for document {{{id_text}}}",
    )


def _zero_like(value: Any) -> Any:
    rank = _num_rank(value)
    return {1: 0, 2: Int64(0), 3: 0.0, 4: Decimal128("0")}[rank]


# ======================================================================================
# Parsing: the update tree
# ======================================================================================


@dataclass(slots=True)
class _Leaf:
    """One modifier applied at one path."""

    op: str
    path: str
    arg: Any
    parsed: Any = None


class _Node:
    """An internal node: object children (applied in name order) or array-filter children."""

    __slots__ = ("children", "is_array")

    def __init__(self, is_array: bool = False) -> None:
        self.children: dict[str, _Node | _Leaf] = {}
        self.is_array = is_array
        """Children are ``$[]`` (key ``""``) / ``$[<id>]`` (key ``id``) array updates."""


def _is_array_filter_part(part: str) -> bool:
    return part.startswith("$[") and part.endswith("]")


def _conflict(path: str, at: str) -> CommandError:
    return CommandError(40, f"Updating the path '{path}' would create a conflict at '{at}'")


class _Parser:
    """Builds the update tree of one operator-style update document."""

    def __init__(self, array_filters: dict[str, dict[str, Any]]) -> None:
        self.root = _Node()
        self.array_filters = array_filters
        self.used_filters: set[str] = set()
        self.positional = False

    def add(self, op: str, path: str, leaf: _Leaf) -> None:
        parts = path.split(".")
        if any(not p for p in parts):
            raise CommandError(
                56,
                f"The update path '{path}' contains an empty field name, which is not allowed.",
            )
        dollar = [i for i, p in enumerate(parts) if p == "$"]
        if len(dollar) > 1:
            raise CommandError(2, f"Too many positional (i.e. '$') elements found in path '{path}'")
        if dollar and dollar[0] == 0:
            raise CommandError(
                2,
                f"Cannot have positional (i.e. '$') element in the first position in path '{path}'",
            )
        self.positional = self.positional or bool(dollar)
        node = self.root
        for i, part in enumerate(parts):
            name = self._child_name(part, i, path)
            if i == len(parts) - 1:
                if name in node.children:
                    raise _conflict(path, path)
                node.children[name] = leaf
                return
            want_array = _is_array_filter_part(parts[i + 1])
            child = node.children.get(name)
            if child is None:
                child = _Node(is_array=want_array)
                node.children[name] = child
            elif not isinstance(child, _Node) or child.is_array != want_array:
                raise _conflict(path, ".".join(parts[: i + 1]))
            node = child

    def _child_name(self, part: str, position: int, path: str) -> str:
        if not _is_array_filter_part(part):
            return part
        if position == 0:
            raise CommandError(
                2,
                "Cannot have array filter identifier (i.e. '$[<id>]') element in the first "
                f"position in path '{path}'",
            )
        ident = part[2:-1]
        if ident and ident not in self.array_filters:
            raise CommandError(
                2, f"No array filter found for identifier '{ident}' in path '{path}'"
            )
        if ident:
            self.used_filters.add(ident)
        return ident


def _parse_leaf(op: str, path: str, arg: Any) -> _Leaf:
    """Validate one modifier argument (mongod's ``*Node::init``)."""
    leaf = _Leaf(op, path, arg)
    if op in ("$inc", "$mul"):
        if not _num_rank(arg):
            verb = "increment" if op == "$inc" else "multiply"
            raise CommandError(
                14, f"Cannot {verb} with non-numeric argument: {{{path}: {bson_repr(arg)}}}"
            )
    elif op == "$currentDate":
        leaf.parsed = _parse_current_date(arg)
    elif op == "$push":
        leaf.parsed = _parse_push(arg)
    elif op == "$addToSet":
        leaf.parsed = _parse_add_to_set(arg)
    elif op == "$pop":
        leaf.parsed = _parse_pop(path, arg)
    elif op == "$pullAll":
        if not isinstance(arg, list):
            raise CommandError(
                2, f"$pullAll requires an array argument but was given a {type_name(arg)}"
            )
    elif op == "$bit":
        leaf.parsed = _parse_bit(arg)
    return leaf


def _parse_current_date(arg: Any) -> str:
    if isinstance(arg, bool):
        return "date"
    if isinstance(arg, dict) and list(arg) == ["$type"] and arg["$type"] in ("date", "timestamp"):
        return str(arg["$type"])
    if isinstance(arg, dict) and list(arg) == ["$type"]:
        raise CommandError(
            2,
            "The '$type' string field is required to be 'date' or 'timestamp': "
            "{$currentDate: {field : {$type: 'date'}}}",
        )
    raise CommandError(
        2,
        f"{type_name(arg)} is not valid type for $currentDate. Please use a boolean ('true') or a "
        "$type expression ({$type: 'timestamp/date'}).",
    )


@dataclass(frozen=True, slots=True)
class _Push:
    values: list[Any]
    position: int | None
    slice: int | None
    sort: Any


def _integer_clause(value: Any, what: str) -> int:
    if isinstance(value, bool) or _num_rank(value) == 0:
        raise CommandError(
            2,
            f"The value for {what} must be an integer value but was given type: {type_name(value)}",
        )
    if isinstance(value, float) and not value.is_integer():
        raise CommandError(
            2,
            f"The value for {what} must be an integer value but was given type: {type_name(value)}",
        )
    return int(value.to_decimal() if isinstance(value, Decimal128) else value)


def _parse_push(arg: Any) -> _Push:
    if not (isinstance(arg, dict) and "$each" in arg):
        return _Push([arg], None, None, None)
    valid = ("$each", "$slice", "$sort", "$position")
    for clause in arg:
        if clause not in valid:
            raise CommandError(2, f"Unrecognized clause in $push: {clause}")
    each = arg["$each"]
    if not isinstance(each, list):
        raise CommandError(
            2,
            f"The argument to $each in $push must be an array but it was of type: "
            f"{type_name(each)}",
        )
    slice_ = _integer_clause(arg["$slice"], "$slice") if "$slice" in arg else None
    position = _integer_clause(arg["$position"], "$position") if "$position" in arg else None
    sort = None
    if "$sort" in arg:
        sort = arg["$sort"]
        if isinstance(sort, dict):
            if not sort:
                raise CommandError(
                    2, "The $sort pattern is empty when it should be a set of fields."
                )
            for field, direction in sort.items():
                if direction not in (1, -1) or isinstance(direction, bool):
                    raise CommandError(2, "The $sort element value must be either 1 or -1")
                if not field or any(not p for p in field.split(".")):
                    raise CommandError(
                        2, f"The $sort field is a dotted field but has an empty part: {field}"
                    )
        elif _num_rank(sort) and not isinstance(sort, bool):
            if sort not in (1, -1):
                raise CommandError(2, "The $sort element value must be either 1 or -1")
        else:
            raise CommandError(
                2,
                "The $sort is invalid: use 1/-1 to sort the whole element, or {field:1/-1} to "
                "sort embedded fields",
            )
    return _Push(list(each), position, slice_, sort)


def _parse_add_to_set(arg: Any) -> list[Any]:
    elements = [arg]
    if isinstance(arg, dict) and arg and next(iter(arg)) == "$each":
        each = arg["$each"]
        if not isinstance(each, list):
            raise CommandError(
                14,
                "The argument to $each in $addToSet must be an array but it was of type "
                f"{type_name(each)}",
            )
        if len(arg) > 1:
            raise CommandError(
                2, f"Found unexpected fields after $each in $addToSet: {bson_repr(arg)}"
            )
        elements = each
    unique: list[Any] = []
    for value in elements:
        if not any(values_equal(value, seen) for seen in unique):
            unique.append(value)
    return unique


def _parse_bit(arg: Any) -> list[tuple[str, int | Int64]]:
    if not isinstance(arg, dict):
        raise CommandError(
            2,
            f"The $bit modifier is not compatible with a {type_name(arg)}. You must pass in an "
            "embedded document: {$bit: {field: {and/or/xor: #}}",
        )
    ops: list[tuple[str, int | Int64]] = []
    for name, value in arg.items():
        if name not in ("and", "or", "xor"):
            raise CommandError(
                2,
                "The $bit modifier only supports 'and', 'or', and 'xor', not '"
                f"{name}' which is an unknown operator: {{{name}: {bson_repr(value)}}}",
            )
        if _num_rank(value) not in (1, 2):
            raise CommandError(
                2,
                "The $bit modifier field must be an Integer(32/64 bit); a "
                f"'{type_name(value)}' is not supported here: {{{name}: {bson_repr(value)}}}",
            )
        ops.append((name, value))
    return ops


def _bitwise(value: Any, ops: list[tuple[str, int | Int64]]) -> Any:
    """``value`` and/or/xor each operand; int32 widens to int64 when either side is int64."""
    rank = _num_rank(value)
    result = int(value)
    for name, operand in ops:
        rank = max(rank, _num_rank(operand))
        if name == "and":
            result &= int(operand)
        elif name == "or":
            result |= int(operand)
        else:
            result ^= int(operand)
    return Int64(result) if rank == 2 else result


def _parse_pop(path: str, arg: Any) -> int:
    if _num_rank(arg) == 0:
        raise CommandError(9, f"Expected a number in: {path}: {bson_repr(arg)}")
    number = float(arg.to_decimal()) if isinstance(arg, Decimal128) else float(arg)
    if number not in (1.0, -1.0):
        raise CommandError(2, f"$pop expects 1 or -1, found: {bson_repr(arg)}")
    return int(number)


def _parse_operator_update(
    update: dict[str, Any], array_filters: list[Any] | None
) -> tuple[_Node, bool]:
    """The update tree of ``update`` and whether it uses the positional ``$``."""
    filters = _parse_array_filters(array_filters)
    parser = _Parser(filters)
    for op, fields in update.items():
        if op not in _MODIFIERS:
            raise CommandError(
                9,
                f"Unknown modifier: {op}. Expected a valid update modifier or pipeline-style "
                "update specified as an array",
            )
        if not isinstance(fields, dict):
            raise CommandError(
                9,
                f"Modifiers operate on fields but we found type {type_name(fields)} instead. "
                f"For example: {{$mod: {{<field>: ...}}}} not {{{op}: {bson_repr(fields)}}}",
            )
        for path, arg in fields.items():
            if op == "$rename":
                _add_rename(parser, path, arg)
            else:
                parser.add(op, path, _parse_leaf(op, path, arg))
    for ident in filters:
        if ident not in parser.used_filters:
            raise CommandError(
                9,
                f"The array filter for identifier '{ident}' was not used in the update "
                f"{bson_repr(update)}",
            )
    return parser.root, parser.positional


def _add_rename(parser: _Parser, source: str, target: Any) -> None:
    parser.add("$placeholder", source, _Leaf("$placeholder", source, None))
    if not isinstance(target, str):
        raise CommandError(
            2, f"The 'to' field for $rename must be a string: {source}: {bson_repr(target)}"
        )
    shown = f'{source}: "{target}"'
    src_parts, dst_parts = source.split("."), target.split(".")
    if src_parts == dst_parts:
        raise CommandError(2, f"The source and target field for $rename must differ: {shown}")
    shorter = min(len(src_parts), len(dst_parts))
    if src_parts[:shorter] == dst_parts[:shorter]:
        raise CommandError(
            2, f"The source and target field for $rename must not be on the same path: {shown}"
        )
    if any(p == "$" or _is_array_filter_part(p) for p in src_parts):
        raise CommandError(2, f"The source field for $rename may not be dynamic: {source}")
    if any(p == "$" or _is_array_filter_part(p) for p in dst_parts):
        raise CommandError(2, f"The destination field for $rename may not be dynamic: {target}")
    parser.add("$rename", target, _Leaf("$rename", target, source))


def _parse_array_filters(array_filters: list[Any] | None) -> dict[str, dict[str, Any]]:
    """``arrayFilters`` by identifier, each rewritten as a query on one element."""
    out: dict[str, dict[str, Any]] = {}
    for flt in array_filters or []:
        if not isinstance(flt, dict) or not flt:
            raise CommandError(
                9, "Cannot use an expression without a top-level field name in arrayFilters"
            )
        ident = None
        query: dict[str, Any] = {}
        for key, cond in flt.items():
            name, _, rest = key.partition(".")
            if not _FILTER_ID.match(name):
                raise CommandError(
                    2,
                    "Error parsing array filter :: caused by :: The top-level field name must be "
                    f"an alphanumeric string beginning with a lowercase letter, found '{name}'",
                )
            if ident is not None and name != ident:
                raise CommandError(
                    9,
                    "Error parsing array filter :: caused by :: Expected a single top-level field "
                    f"name, found '{ident}' and '{name}'",
                )
            ident = name
            query["__elem" + ("." + rest if rest else "")] = cond
        assert ident is not None
        if ident in out:
            raise CommandError(
                9, f"Found multiple array filters with the same top-level field name {ident}"
            )
        out[ident] = query
    return out




