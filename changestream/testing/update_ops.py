"""Update documents and the ``$v: 2`` oplog diffs mongod logs for them.

Operator updates follow mongod's update tree (``update_object_node.cpp``):
the paths of all modifiers are merged into one tree whose children are applied
in field-name order, each modifier deciding whether it changed anything, and
every change is recorded the way ``V2LogBuilder`` records it (``u`` updated,
``i`` created, ``d`` deleted, ``s<field>`` sub-diffs, array diffs
``{a: true, u<idx>: ...}``). Appends by ``$push``/``$addToSet`` log only the
new elements; other array rewrites log the whole array. A modifier that
changes nothing logs nothing, and an update that changes nothing produces no
oplog entry at all.

Replacement updates log the whole new document; pipeline-style updates are
evaluated stage by stage and logged as the diff of the two images
(:func:`~changestream.testing.changestreams.diff.diff_or_replacement`). The
``$project`` evaluation is shared with find projections (:func:`project`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from bson.decimal128 import Decimal128, create_decimal128_context
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp
from mongomock import aggregate as _mm_aggregate

from .changestreams.diff import diff_or_replacement
from .errors import CommandError
from .storage import (
    bson_repr,
    compare_values,
    copy_value,
    matches,
    path_values,
    type_name,
    values_equal,
    values_identical,
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


# ======================================================================================
# The $v:2 diff (V2LogBuilder)
# ======================================================================================

_DOC, _ARRAY, _INSERT = 0, 1, 2
Path = list[tuple[str, bool]]
"""A runtime path: ``(component, is_array_index)`` pairs."""


class _DiffNode:
    __slots__ = ("children", "deletes", "inserts", "kind", "subdiffs", "updates")

    def __init__(self, kind: int) -> None:
        self.kind = kind
        self.children: dict[str, Any] = {}
        self.deletes: list[str] = []
        self.updates: list[tuple[str, Any]] = []
        self.inserts: list[tuple[str, Any]] = []
        self.subdiffs: list[tuple[str, _DiffNode]] = []

    def add(self, name: str, child: Any) -> None:
        self.children[name] = child
        if self.kind != _DOC:
            return
        if isinstance(child, _DiffNode):
            (self.inserts if child.kind == _INSERT else self.subdiffs).append((name, child))
        elif child[0] == "d":
            self.deletes.append(name)
        elif child[0] == "u":
            self.updates.append((name, child[1]))
        else:
            self.inserts.append((name, child))


class DiffLog:
    """Collects logged changes and serializes them as a ``$v: 2`` diff."""

    def __init__(self) -> None:
        self.root = _DiffNode(_DOC)
        self.empty = True

    def updated(self, path: Path, value: Any) -> None:
        self._add(path, ("u", value), None)

    def created(self, path: Path, first_new: int, value: Any) -> None:
        self._add(path, ("i", value), first_new)

    def deleted(self, path: Path) -> None:
        self._add(path, ("d", None), None)

    def _add(self, path: Path, leaf: tuple[str, Any], first_new: int | None) -> None:
        self.empty = False
        node = self.root
        for i, (part, _) in enumerate(path[:-1]):
            child = node.children.get(part)
            if child is None:
                if path[i + 1][1]:
                    kind = _ARRAY
                elif first_new is not None and i >= first_new:
                    kind = _INSERT
                else:
                    kind = _DOC
                child = _DiffNode(kind)
                node.add(part, child)
            node = child
        node.add(path[-1][0], leaf)

    def serialize(self) -> dict[str, Any]:
        return _serialize(self.root)


def _serialize(node: _DiffNode) -> dict[str, Any]:
    if node.kind == _INSERT:
        return {
            name: _serialize(child) if isinstance(child, _DiffNode) else copy_value(child[1])
            for name, child in node.children.items()
        }
    if node.kind == _ARRAY:
        out: dict[str, Any] = {"a": True}
        for name in sorted(node.children, key=int):
            child = node.children[name]
            if not isinstance(child, _DiffNode):
                out[f"u{name}"] = copy_value(child[1])
            elif child.kind == _INSERT:
                out[f"u{name}"] = _serialize(child)
            else:
                out[f"s{name}"] = _serialize(child)
        return out
    out = {}
    if node.deletes:
        out["d"] = dict.fromkeys(node.deletes, False)
    if node.updates:
        out["u"] = {name: copy_value(value) for name, value in node.updates}
    if node.inserts:
        out["i"] = {
            name: _serialize(child) if isinstance(child, _DiffNode) else copy_value(child[1])
            for name, child in node.inserts
        }
    for name, child in node.subdiffs:
        out["s" + name] = _serialize(child)
    return out


# ======================================================================================
# Applying an operator update
# ======================================================================================

_NOOP, _NORMAL = 0, 1
"""Results of a modifier on an existing element; a positive ``n + 1`` means "appended n"."""


def _dotted(path: Path) -> str:
    return ".".join(part for part, _ in path)


def _index(part: str) -> int | None:
    return int(part) if part.isdigit() and (part == "0" or not part.startswith("0")) else None


def _not_viable(part: str, name: str, elem: Any) -> CommandError:
    return CommandError(
        28,
        f"Cannot create field '{part}' in element {{{name}: {bson_repr(elem)}}}",
        code_name="PathNotViable",
    )


def _elem_matches(query: dict[str, Any], element: Any) -> bool:
    return matches(query, {"__elem": element})


class _Applier:
    """Applies one update tree to a working copy of one document."""

    def __init__(
        self,
        doc: dict[str, Any],
        env: UpdateEnv,
        *,
        is_insert: bool,
        matched: str | None,
        array_filters: dict[str, dict[str, Any]],
    ) -> None:
        self.doc = doc
        self.env = env
        self.is_insert = is_insert
        self.matched = matched
        self.array_filters = array_filters
        self.log: DiffLog | None = DiffLog()

    @property
    def id_text(self) -> str:
        return f"_id: {bson_repr(self.doc['_id'])}" if "_id" in self.doc else "no id"

    # -- internal nodes -----------------------------------------------------------------
    def apply(
        self, node: _Node | _Leaf, holder: Any, key: Any, elem: Any, taken: Path, create: list[str]
    ) -> bool:
        if isinstance(node, _Leaf):
            return self._leaf(node, holder, key, elem, taken, create)
        if node.is_array:
            return self._array(node, elem, taken, create)
        return self._object(node, holder, key, elem, taken, create)

    def _ordered(self, node: _Node) -> list[tuple[str, _Node | _Leaf]]:
        names = sorted(k for k in node.children if k != "$")
        ordered = [(k, node.children[k]) for k in names]
        if "$" in node.children:
            if self.matched is None:
                raise CommandError(
                    2, "The positional operator did not find the match needed from the query."
                )
            if self.matched in node.children:
                raise _conflict(self.matched, self.matched)
            ordered.append((self.matched, node.children["$"]))
            ordered.sort(key=lambda item: item[0])
        return ordered

    def _object(
        self, node: _Node, holder: Any, key: Any, elem: Any, taken: Path, create: list[str]
    ) -> bool:
        modified = False
        for name, child in self._ordered(node):
            if create:
                c_holder, c_key, c_elem, c_taken, c_create = (
                    holder,
                    key,
                    elem,
                    taken,
                    [*create, name],
                )
            elif isinstance(elem, dict) and name in elem:
                c_holder, c_key, c_elem = elem, name, elem[name]
                c_taken, c_create = [*taken, (name, False)], []
            elif isinstance(elem, list) and (idx := _index(name)) is not None and idx < len(elem):
                c_holder, c_key, c_elem = elem, idx, elem[idx]
                c_taken, c_create = [*taken, (name, True)], []
            else:
                c_holder, c_key, c_elem, c_taken, c_create = holder, key, elem, taken, [name]
            modified = self.apply(child, c_holder, c_key, c_elem, c_taken, c_create) or modified
            if create:  # a child may have created the missing path: continue from there
                found = self._resolve(elem, create)
                if found is not None:
                    holder, key, elem = found[0], found[1], found[2]
                    taken = [*taken, *found[3]]
                    create = []
        return modified

    @staticmethod
    def _resolve(elem: Any, parts: list[str]) -> tuple[Any, Any, Any, Path] | None:
        holder: Any = None
        key: Any = None
        path: Path = []
        for part in parts:
            if isinstance(elem, dict) and part in elem:
                holder, key, elem = elem, part, elem[part]
                path.append((part, False))
            elif isinstance(elem, list) and (idx := _index(part)) is not None and idx < len(elem):
                holder, key, elem = elem, idx, elem[idx]
                path.append((part, True))
            else:
                return None
        return holder, key, elem, path

    def _array(self, node: _Node, elem: Any, taken: Path, create: list[str]) -> bool:
        if create:
            raise CommandError(
                2,
                f"The path '{_dotted(taken + [(p, False) for p in create])}' must exist in the "
                "document in order to apply array updates.",
            )
        if not isinstance(elem, list):
            raise CommandError(
                2,
                f"Cannot apply array updates to non-array element {taken[-1][0]}: "
                f"{bson_repr(elem)}",
            )
        targets: list[tuple[int, list[tuple[str, _Node | _Leaf]]]] = []
        for i, item in enumerate(elem):
            children = [
                (ident, child)
                for ident, child in sorted(node.children.items())
                if not ident or _elem_matches(self.array_filters[ident], item)
            ]
            if children:
                targets.append((i, children))
        if len(targets) == 1:  # one element: the children log their own paths
            return self._apply_element(elem, *targets[0], taken)
        saved, self.log = self.log, None
        changed: list[int] = []
        try:
            for i, children in targets:
                if self._apply_element(elem, i, children, taken):
                    changed.append(i)
        finally:
            self.log = saved
        if self.log is not None and len(changed) > 1:
            self.log.updated(taken, elem)
        elif self.log is not None and changed:
            self.log.updated([*taken, (str(changed[0]), True)], elem[changed[0]])
        return bool(changed)

    def _apply_element(
        self, array: list[Any], i: int, children: list[tuple[str, _Node | _Leaf]], taken: Path
    ) -> bool:
        modified = False
        for _, child in children:
            modified = (
                self.apply(child, array, i, array[i], [*taken, (str(i), True)], []) or modified
            )
        return modified

    # -- leaves -----------------------------------------------------------------------------
    def _leaf(
        self, leaf: _Leaf, holder: Any, key: Any, elem: Any, taken: Path, create: list[str]
    ) -> bool:
        if leaf.op == "$setOnInsert" and not self.is_insert:
            return False
        if leaf.op == "$rename":
            return self._rename(leaf, holder, key, elem, taken, create)
        if create:
            if leaf.op in _NO_CREATE:
                return False
            return self._create(leaf, elem, taken, create, self._new_value(leaf))
        result = self._update_existing(leaf, holder, key, elem, taken)
        if result == _NOOP:
            return False
        self._check_immutable(taken)
        if self.log is None:
            return True
        if result == _NORMAL:
            if leaf.op == "$unset" and not taken[-1][1]:
                self.log.deleted(taken)
            else:
                self.log.updated(taken, holder[key])
        else:
            array = holder[key]
            for j in range(len(array) - (result - 1), len(array)):
                self.log.created([*taken, (str(j), True)], len(taken), array[j])
        return True

    def _check_immutable(self, path: Path) -> None:
        if path and path[0][0] == "_id":
            raise CommandError(
                66,
                f"Performing an update on the path '{_dotted(path)}' would modify the immutable "
                "field '_id'",
            )

    def _create(
        self, leaf: _Leaf | None, elem: Any, taken: Path, create: list[str], value: Any
    ) -> bool:
        """Create ``create`` under ``elem`` holding ``value`` and log it (PathCreatingNode)."""
        name = taken[-1][0] if taken else ""
        first, rest = create[0], create[1:]
        if isinstance(elem, dict):
            first_is_index = False
            target: Any = elem
            target_key: Any = first
        elif isinstance(elem, list):
            idx = _index(first)
            if idx is None:
                raise _not_viable(first, name, elem)
            first_is_index = True
            elem.extend([None] * (idx + 1 - len(elem)))
            target, target_key = elem, idx
        else:
            raise _not_viable(first, name, elem)
        if leaf is not None and leaf.op in ("$set", "$setOnInsert") and not taken:
            _check_top_level_name(first)
        full: Path = [*taken, (first, first_is_index), *((p, False) for p in rest)]
        if full[0][0] == "_id" and (taken or rest):
            self._check_immutable(full)
        for part in rest:
            new: dict[str, Any] = {}
            target[target_key] = new
            target, target_key = new, part
        target[target_key] = value
        if self.log is not None:
            self.log.created(full, len(taken), value)
        return True

    def _new_value(self, leaf: _Leaf) -> Any:
        op, arg = leaf.op, leaf.arg
        if op in ("$set", "$setOnInsert", "$min", "$max", "$inc"):
            return copy_value(arg)
        if op == "$mul":
            return _zero_like(arg)
        if op == "$currentDate":
            return self.env.now() if leaf.parsed == "date" else self.env.timestamp()
        if op == "$bit":
            return _bitwise(0, leaf.parsed)
        if op == "$push":
            array: list[Any] = []
            self._push(leaf.parsed, array)
            return array
        if op == "$addToSet":
            return copy_value(list(leaf.parsed))
        raise AssertionError(op)

    def _update_existing(self, leaf: _Leaf, holder: Any, key: Any, elem: Any, taken: Path) -> int:
        op, arg = leaf.op, leaf.arg
        if op in ("$set", "$setOnInsert"):
            if values_identical(elem, arg):
                return _NOOP
            holder[key] = copy_value(arg)
            return _NORMAL
        if op == "$unset":
            if isinstance(holder, list):
                holder[key] = None
            else:
                del holder[key]
            return _NORMAL
        if op in ("$inc", "$mul"):
            if not _num_rank(elem):
                raise CommandError(
                    14,
                    f"Cannot apply {op} to a value of non-numeric type. {{{self.id_text}}} has "
                    f"the field '{key}' of non-numeric type {type_name(elem)}",
                )
            result = _arith(op, elem, arg, self.id_text)
            if values_identical(result, elem):
                return _NOOP
            holder[key] = result
            return _NORMAL
        if op in ("$min", "$max"):
            cmp = compare_values(elem, arg)
            if cmp == 0 or (op == "$max") != (cmp < 0):
                return _NOOP
            holder[key] = copy_value(arg)
            return _NORMAL
        if op == "$currentDate":
            holder[key] = self._new_value(leaf)
            return _NORMAL
        if op == "$bit":
            if _num_rank(elem) not in (1, 2):
                raise CommandError(
                    2,
                    f"Cannot apply $bit to a value of non-integral type.{{{self.id_text}}} has "
                    f"the field {key} of non-integer type {type_name(elem)}",
                )
            result = _bitwise(elem, leaf.parsed)
            if values_identical(result, elem):
                return _NOOP
            holder[key] = result
            return _NORMAL
        if op == "$placeholder":
            return _NOOP
        if not isinstance(elem, list):
            raise self._not_array(op, key, elem, taken)
        if op == "$push":
            return self._push(leaf.parsed, elem)
        if op == "$addToSet":
            added = [v for v in leaf.parsed if not any(values_equal(v, e) for e in elem)]
            if not added:
                return _NOOP
            elem.extend(copy_value(added))
            return len(added) + 1
        if op == "$pop":
            if not elem:
                return _NOOP
            elem.pop(0 if leaf.parsed == -1 else -1)
            return _NORMAL
        keep = self._cull(op, arg, elem)
        if len(keep) == len(elem):
            return _NOOP
        elem[:] = keep
        return _NORMAL

    def _not_array(self, op: str, key: Any, elem: Any, taken: Path) -> CommandError:
        if op == "$push":
            return CommandError(
                2,
                f"The field '{_dotted(taken)}' must be an array but is of type "
                f"{type_name(elem)} in document {{{self.id_text}}}",
            )
        if op == "$addToSet":
            return CommandError(
                2,
                f"Cannot apply $addToSet to non-array field. Field named '{key}' has non-array "
                f"type {type_name(elem)}",
            )
        if op == "$pop":
            return CommandError(
                14,
                f"Path '{_dotted(taken)}' contains an element of non-array type "
                f"'{type_name(elem)}'",
            )
        return CommandError(2, f"Cannot apply {op} to a non-array value")

    def _cull(self, op: str, arg: Any, array: list[Any]) -> list[Any]:
        """The elements ``$pull``/``$pullAll`` keep."""
        if op == "$pullAll":
            return [e for e in array if not any(values_equal(e, v) for v in arg)]
        if isinstance(arg, dict) and arg and all(k.startswith("$") for k in arg):
            return [e for e in array if not matches({"__elem": arg}, {"__elem": e})]
        if isinstance(arg, dict) and arg:
            return [e for e in array if not (isinstance(e, dict) and matches(arg, e))]
        return [e for e in array if not values_equal(e, arg)]

    def _push(self, push: _Push, array: list[Any]) -> int:
        """Apply a ``$push`` to ``array`` in place (PushNode::performPush)."""
        values = copy_value(push.values)
        size = len(array)
        result = _NOOP
        if values:
            position = push.position
            if size == 0:
                array.extend(values)
                result = _NORMAL
            elif position is None or position > size:
                array.extend(values)
                result = len(values) + 1
            else:
                at = position if position >= 0 else max(size + position, 0)
                array[at:at] = values
                result = _NORMAL
        if push.sort is not None:
            result = _NORMAL
            array.sort(key=_push_sort_key(push.sort))
        if push.slice is not None and len(array) > abs(push.slice):
            result = _NORMAL
            if push.slice >= 0:
                del array[push.slice :]
            else:
                del array[: len(array) + push.slice]
        return result

    # -- $rename ----------------------------------------------------------------------------
    def _rename(
        self, leaf: _Leaf, holder: Any, key: Any, elem: Any, taken: Path, create: list[str]
    ) -> bool:
        """Set the destination to the source's value, then delete the source (RenameNode)."""
        source = str(leaf.arg)
        parts = source.split(".")
        parent: Any = self.doc
        for i, part in enumerate(parts[:-1]):
            nxt = parent.get(part, _MISSING)
            if isinstance(nxt, list):
                raise CommandError(
                    2,
                    f"The source field cannot be an array element, '{source}' in doc with "
                    f"{self.id_text} has an array field called '{part}'",
                )
            if nxt is _MISSING:
                return False
            if not isinstance(nxt, dict):
                raise _not_viable(parts[i + 1], part, nxt)
            parent = nxt
        if parts[-1] not in parent:
            return False
        array_at = next((i for i, (_, is_index) in enumerate(taken) if is_index), None)
        if array_at is not None or (create and isinstance(elem, list)):
            name = taken[array_at - 1][0] if array_at else (taken[-1][0] if taken else "")
            raise CommandError(
                2,
                f"The destination field cannot be an array element, '{leaf.path}' in doc with "
                f"{self.id_text} has an array field called '{name}'",
            )
        value = parent[parts[-1]]
        if create:
            self._create(None, elem, taken, create, copy_value(value))
        elif not values_equal(elem, value):
            self._check_immutable(taken)
            holder[key] = copy_value(value)
            if self.log is not None:
                self.log.updated(taken, holder[key])
        if parts[0] == "_id":
            raise CommandError(
                66,
                f"Unsetting the path '{source}' using $rename would modify the immutable field "
                "'_id'",
            )
        del parent[parts[-1]]
        if self.log is not None:
            self.log.deleted([(p, False) for p in parts])
        return True


def _push_sort_key(pattern: Any) -> Callable[[Any], Any]:
    if isinstance(pattern, dict):
        fields = list(pattern.items())

        def cmp(x: Any, y: Any) -> int:
            if isinstance(x, dict) and isinstance(y, dict):
                for field, direction in fields:
                    vx, vy = path_values(x, field), path_values(y, field)
                    c = compare_values(vx[0] if vx else None, vy[0] if vy else None)
                    if c:
                        return c * int(direction)
                return 0
            return compare_values(x, y) * int(fields[0][1])

        return functools.cmp_to_key(cmp)
    direction = int(pattern)
    return functools.cmp_to_key(lambda x, y: compare_values(x, y) * direction)


def _check_top_level_name(name: str) -> None:
    if name.startswith("$"):
        raise CommandError(
            52,
            f"The dollar ($) prefixed field '{name}' in '{name}' is not allowed in the context of "
            "an update's replacement document. Consider using an aggregation pipeline with "
            "$replaceWith.",
        )


# ======================================================================================
# Positional matching ("$" = the index the query matched)
# ======================================================================================


def positional_match(query: dict[str, Any], doc: dict[str, Any]) -> str | None:
    """The array index the query matched in ``doc`` (what ``$`` stands for), or None."""
    for key, cond in query.items():
        if key == "$and" and isinstance(cond, list):
            for sub in cond:
                found = positional_match(sub, doc) if isinstance(sub, dict) else None
                if found is not None:
                    return found
            continue
        if key.startswith("$"):
            continue
        found_idx = _first_matching_index(doc, key.split("."), cond)
        if found_idx is not None:
            return str(found_idx)
    return None


def _first_matching_index(value: Any, parts: list[str], cond: Any) -> int | None:
    for j, part in enumerate(parts):
        if isinstance(value, list):
            rest = parts[j:]
            for i, item in enumerate(value):
                if isinstance(item, dict) and matches({".".join(rest): cond}, item):
                    return i
            return None
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if isinstance(value, list):
        for i, item in enumerate(value):
            if matches({"__elem": cond}, {"__elem": [item]}):
                return i
    return None


# ======================================================================================
# Pipeline-style updates
# ======================================================================================
_PIPELINE_STAGES = ("$addFields", "$set", "$project", "$unset", "$replaceRoot", "$replaceWith")


def _evaluate(expr: Any, doc: dict[str, Any]) -> Any:
    """An aggregation expression against ``doc``; ``_MISSING`` when it yields nothing."""
    if isinstance(expr, str) and expr in ("$$REMOVE",):
        return _MISSING
    if isinstance(expr, str) and expr == "$$ROOT":
        return copy_value(doc)
    try:
        return _mm_aggregate._parse_expression(expr, doc, ignore_missing_keys=True)  # type: ignore[no-untyped-call]
    except KeyError:
        return _MISSING
    except NotImplementedError as exc:
        raise CommandError(168, f"unsupported expression in the simulator: {exc}") from None
    except CommandError:
        raise
    except Exception as exc:  # mongomock raises OperationFailure & co.
        raise CommandError(2, str(exc)) from None


def _set_fields(doc: dict[str, Any], spec: dict[str, Any], source: dict[str, Any]) -> None:
    """``$set``/``$addFields``: nested specs merge into sub-documents."""
    for field, expr in spec.items():
        parts = field.split(".")
        target = doc
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        name = parts[-1]
        if isinstance(expr, dict) and expr and not any(k.startswith("$") for k in expr):
            if not isinstance(target.get(name), dict):
                target[name] = {}
            _set_fields(target[name], expr, source)
            continue
        value = _evaluate(expr, source)
        if value is _MISSING:
            target.pop(name, None)
        else:
            target[name] = value


def _unset_paths(doc: dict[str, Any], paths: list[str]) -> None:
    for path in paths:
        parts = path.split(".")
        target: Any = doc
        for part in parts[:-1]:
            target = target.get(part) if isinstance(target, dict) else None
        if isinstance(target, dict):
            target.pop(parts[-1], None)


def _is_flag(value: Any) -> bool:
    return isinstance(value, (bool, int, float, Decimal128))


def _project(doc: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """``$project``: an inclusion (with computed fields) or an exclusion projection."""
    fields = {k: v for k, v in spec.items() if k != "_id"}
    include_id = not (_is_flag(spec.get("_id", True)) and not spec.get("_id", True))
    inclusion = any(not _is_flag(v) or bool(v) for v in fields.values())
    if not inclusion:
        out: dict[str, Any] = copy_value(doc)
        _unset_paths(out, list(fields) + ([] if include_id else ["_id"]))
        return out
    out = {}
    if "_id" in spec and not _is_flag(spec["_id"]):
        _set_fields(out, {"_id": spec["_id"]}, doc)
    elif include_id and "_id" in doc:
        out["_id"] = copy_value(doc["_id"])
    for field, value in fields.items():
        if not _is_flag(value):
            _set_fields(out, {field: value}, doc)
        elif not value:
            raise CommandError(
                31254,
                f"Invalid $project :: caused by :: Cannot do exclusion on field {field} in "
                "inclusion projection",
            )
        else:
            values = path_values(doc, field)
            if values:
                _set_path(out, field, copy_value(values[0]))
    return out


def _slice(array: list[Any], arg: Any) -> list[Any]:
    if isinstance(arg, list) and len(arg) == 2:
        skip, limit = int(arg[0]), int(arg[1])
        if limit <= 0:
            raise CommandError(
                28724,
                "Second argument to $slice must be a positive number",
                code_name="Location28724",
            )
        start = skip if skip >= 0 else max(len(array) + skip, 0)
        return array[start : start + limit]
    if isinstance(arg, bool) or _num_rank(arg) == 0:
        raise CommandError(
            28667, f"Invalid $slice syntax: {bson_repr(arg)}", code_name="Location28667"
        )
    n = int(arg)
    return array[:n] if n >= 0 else array[max(len(array) + n, 0) :]


def _find_operator(doc: dict[str, Any], field: str, op: str, arg: Any) -> None:
    """Apply a find-only projection operator (``$slice``/``$elemMatch``) in place."""
    parts = field.split(".")
    target: Any = doc
    for part in parts[:-1]:
        target = target.get(part) if isinstance(target, dict) else None
    if not isinstance(target, dict) or not isinstance(target.get(parts[-1]), list):
        if op == "$elemMatch" and isinstance(target, dict):
            target.pop(parts[-1], None)
        return
    array = target[parts[-1]]
    if op == "$slice":
        target[parts[-1]] = _slice(array, arg)
        return
    if not isinstance(arg, dict):
        raise CommandError(2, "elemMatch: Invalid argument, object required.")
    found = next(
        (e for e in array if matches({"__elem": {"$elemMatch": arg}}, {"__elem": [e]})), _MISSING
    )
    if found is _MISSING:
        del target[parts[-1]]
    else:
        target[parts[-1]] = [found]


def project(
    doc: dict[str, Any], spec: dict[str, Any], *, query: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A find projection of ``doc`` (a new document): inclusion or exclusion, computed
    fields, ``$slice``, ``$elemMatch`` and the positional ``field.$``."""
    work: dict[str, Any] = copy_value(doc)
    base: dict[str, Any] = {}
    included: list[str] = []
    for field, value in spec.items():
        if (
            isinstance(value, dict)
            and len(value) == 1
            and next(iter(value)) in ("$slice", "$elemMatch")
        ):
            op, arg = next(iter(value.items()))
            _find_operator(work, field, op, arg)
            included.append(field)
        elif field.endswith(".$"):
            array_field = field[:-2]
            matched = positional_match(query or {}, doc)
            values = path_values(work, array_field)
            if matched is None or not values or not isinstance(values[0], list):
                raise CommandError(
                    51246,
                    "Executor error during find command :: caused by :: positional operator "
                    "'.$' couldn't find a matching element in the array",
                    code_name="Location51246",
                )
            _set_path(work, array_field, [values[0][int(matched)]])
            base[array_field] = 1
        else:
            base[field] = value
    flags = [v for k, v in base.items() if k != "_id"]
    if any(not _is_flag(v) or bool(v) for v in flags):
        for field in included:
            base.setdefault(field, 1)
    return _project(work, base)


def apply_pipeline(pipeline: list[Any], doc: dict[str, Any]) -> dict[str, Any]:
    """Evaluate an update pipeline on (a copy of) ``doc``."""
    current: dict[str, Any] = copy_value(doc)
    for stage in pipeline:
        if not isinstance(stage, dict) or len(stage) != 1:
            raise CommandError(
                40323, "A pipeline stage specification object must contain exactly one field."
            )
        name, spec = next(iter(stage.items()))
        if name not in _PIPELINE_STAGES:
            raise CommandError(
                72, f"{name} is not allowed to be used within an update", code_name="InvalidOptions"
            )
        if name in ("$set", "$addFields"):
            if not isinstance(spec, dict):
                raise CommandError(
                    40272, f"{name} specification stage must be an object, got {type_name(spec)}"
                )
            new = copy_value(current)
            _set_fields(new, spec, current)
            current = new
        elif name == "$unset":
            paths = [spec] if isinstance(spec, str) else spec
            if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
                raise CommandError(
                    31002,
                    "$unset specification must be a string or an array "
                    "containing only string values",
                )
            _unset_paths(current, paths)
        elif name == "$project":
            if not isinstance(spec, dict):
                raise CommandError(15969, "$project specification must be an object")
            current = _project(current, spec)
        else:
            expr = spec.get("newRoot", _MISSING) if name == "$replaceRoot" else spec
            if name == "$replaceRoot" and (not isinstance(spec, dict) or expr is _MISSING):
                raise CommandError(40231, "no newRoot specified for the $replaceRoot stage")
            value = _evaluate(expr, current)
            if not isinstance(value, dict):
                shown = "missing" if value is _MISSING else bson_repr(value)
                raise CommandError(
                    40228,
                    "'replacement document' must evaluate to an object, but resulting value was: "
                    f"{shown}. Type of resulting value: '{'missing' if value is _MISSING else type_name(value)}'.",
                )
            current = value
    return current


# ======================================================================================
# The public entry points
# ======================================================================================


def is_operator_update(update: Any) -> bool:
    return isinstance(update, dict) and bool(update) and next(iter(update)).startswith("$")


class Update:
    """One parsed ``u`` of an update statement (operator, replacement or pipeline)."""

    def __init__(
        self,
        spec: Any,
        *,
        array_filters: list[Any] | None = None,
        multi: bool = False,
    ) -> None:
        self.spec = spec
        self.tree: _Node | None = None
        self.positional = False
        self.filters: dict[str, dict[str, Any]] = {}
        if isinstance(spec, list):
            self.kind = "pipeline"
            if array_filters:
                raise CommandError(
                    9, "arrayFilters may not be specified for pipeline-style updates"
                )
        elif not isinstance(spec, dict):
            raise CommandError(
                14,
                f"BSON field 'update.updates.u' is the wrong type '{type_name(spec)}', expected "
                "type 'object' or 'array'",
            )
        elif is_operator_update(spec):
            self.kind = "operator"
            self.tree, self.positional = _parse_operator_update(spec, array_filters)
            self.filters = _parse_array_filters(array_filters)
        else:
            self.kind = "replacement"
            if multi:
                raise CommandError(9, "multi update is not supported for replacement-style update")
            if array_filters:
                raise CommandError(
                    2, "arrayFilters may not be specified for replacement-style updates"
                )
            for name in spec:
                _check_top_level_name(name)

    def apply(
        self,
        doc: dict[str, Any],
        env: UpdateEnv,
        *,
        query: dict[str, Any] | None = None,
        is_insert: bool = False,
    ) -> Outcome:
        """Apply to ``doc`` (not modified); the new document and what to log."""
        if self.kind == "replacement":
            return self._replace(doc)
        if self.kind == "pipeline":
            return self._pipeline(doc)
        assert self.tree is not None
        work = copy_value(doc)
        matched = positional_match(query or {}, doc) if self.positional else None
        applier = _Applier(
            work, env, is_insert=is_insert, matched=matched, array_filters=self.filters
        )
        modified = applier.apply(self.tree, None, None, work, [], [])
        if not modified or applier.log is None or applier.log.empty:
            return Outcome(doc, None)
        return Outcome(work, {"$v": 2, "diff": applier.log.serialize()})

    def _replace(self, doc: dict[str, Any]) -> Outcome:
        new: dict[str, Any] = {}
        if "_id" in doc:
            if "_id" in self.spec and not values_equal(self.spec["_id"], doc["_id"]):
                raise _id_altered(self.spec["_id"])
            new["_id"] = doc["_id"]
        for name, value in self.spec.items():
            if name != "_id" or "_id" not in new:
                new[name] = copy_value(value)
        if values_identical(new, doc):
            return Outcome(doc, None)
        return Outcome(new, copy_value(new), replacement=True)

    def _pipeline(self, doc: dict[str, Any]) -> Outcome:
        result = apply_pipeline(self.spec, doc)
        new: dict[str, Any] = {}
        if "_id" in doc:
            if "_id" in result and not values_equal(result["_id"], doc["_id"]):
                raise _id_altered(result["_id"])
            new["_id"] = doc["_id"]
        for name, value in result.items():
            if name != "_id" or "_id" not in new:
                new[name] = value
        kind, diff = diff_or_replacement(doc, new)
        if kind == "noop":
            return Outcome(doc, None)
        if kind == "diff":
            assert diff is not None
            return Outcome(new, {"$v": 2, "diff": diff})
        return Outcome(new, copy_value(new), replacement=True)

    def upsert_document(self, query: dict[str, Any], env: UpdateEnv) -> dict[str, Any]:
        """The document an upsert inserts: query equalities + the update, ``_id`` first."""
        if self.kind == "replacement":
            seed: dict[str, Any] = {}
            equalities = _equalities(query)
            if "_id" in equalities:
                seed["_id"] = equalities["_id"]
            doc = self._replace(seed).doc if seed else copy_value(self.spec)
        else:
            seed = {}
            for path, value in sorted(_equalities(query).items()):
                _set_path(seed, path, copy_value(value))
            if self.kind == "pipeline":
                doc = apply_pipeline(self.spec, seed)
            else:
                doc = self.apply(seed, env, is_insert=True).doc
        if "_id" not in doc:
            return {"_id": ObjectId(), **doc}
        if next(iter(doc)) != "_id":
            return {"_id": doc["_id"], **{k: v for k, v in doc.items() if k != "_id"}}
        return doc


def _id_altered(value: Any) -> CommandError:
    return CommandError(
        66,
        "After applying the update, the (immutable) field '_id' was found to have been altered "
        f"to _id: {bson_repr(value)}",
    )


def _equalities(query: dict[str, Any]) -> dict[str, Any]:
    """The ``path: value`` equalities of a query (``extractEqualityMatches``)."""
    out: dict[str, Any] = {}
    for key, cond in query.items():
        if key == "$and" and isinstance(cond, list):
            for sub in cond:
                if isinstance(sub, dict):
                    out.update(_equalities(sub))
            continue
        if key.startswith("$") or isinstance(cond, (Regex, re.Pattern)):
            continue
        if isinstance(cond, dict) and any(k.startswith("$") for k in cond):
            if list(cond) == ["$eq"]:
                out[key] = cond["$eq"]
            elif list(cond) == ["$in"] and isinstance(cond["$in"], list) and len(cond["$in"]) == 1:
                out[key] = cond["$in"][0]
            continue
        out[key] = cond
    return out


def _set_path(doc: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    target = doc
    for part in parts[:-1]:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    target[parts[-1]] = value
