"""Dotted paths and query matching (mongomock's matcher with mongod's errors, and a
fast path for top-level scalar equalities).
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp

from ..core import _mongomock
from ..core.errors import CommandError
from .order import bson_repr, id_key
from .where import compile_where

if TYPE_CHECKING:
    pass

# -- paths and queries -----------------------------------------------------------


def path_values(doc: Any, path: str) -> list[Any]:
    """Every value reached by dotted ``path``, traversing arrays as mongod does.

    Arrays met on the way are expanded (``a.b`` over ``a: [{b: 1}, {b: 2}]``
    gives ``[1, 2]``); a numeric component may also index the array. A leaf
    array is returned as one value. Missing paths give ``[]``.
    """
    return _path_values(doc, path.split("."), 0)


def _path_values(value: Any, parts: list[str], i: int) -> list[Any]:
    if i == len(parts):
        return [value]
    part = parts[i]
    if isinstance(value, dict):
        if part in value:
            return _path_values(value[part], parts, i + 1)
        return []
    if isinstance(value, list):
        out: list[Any] = []
        if part.isdigit() and int(part) < len(value):
            out.extend(_path_values(value[int(part)], parts, i + 1))
        for item in value:
            if isinstance(item, dict):
                out.extend(_path_values(item, parts, i))
        return out
    return []


_TS_OPERATORS: dict[str, Callable[[Timestamp, Timestamp], bool]] = {
    "$eq": operator.eq,
    "$ne": operator.ne,
    "$gt": operator.gt,
    "$gte": operator.ge,
    "$lt": operator.lt,
    "$lte": operator.le,
}


def _timestamp_clause(cond: Any) -> bool:
    """Whether ``cond`` compares with a Timestamp (mongomock cannot: the oplog's ``ts``)."""
    if isinstance(cond, Timestamp):
        return True
    return (
        isinstance(cond, dict)
        and bool(cond)
        and all(op in _TS_OPERATORS for op in cond)
        and any(isinstance(v, Timestamp) for v in cond.values())
    )


def _timestamp_matches(doc: dict[str, Any], path: str, cond: Any) -> bool:
    """Comparisons within the Timestamp type bracket, as mongod compares them."""
    ops = {"$eq": cond} if isinstance(cond, Timestamp) else cond
    values = [v for v in path_values(doc, path) if isinstance(v, Timestamp)]
    for op, arg in ops.items():
        if op == "$ne":
            if any(v == arg for v in values):
                return False
        elif not any(isinstance(arg, Timestamp) and _TS_OPERATORS[op](v, arg) for v in values):
            return False
    return True


def matches(query: dict[str, Any], doc: dict[str, Any]) -> bool:
    """Whether ``doc`` matches the query filter (mongomock's matcher, mongod's errors)."""
    if not query:
        return True
    timestamps = [k for k, v in query.items() if not k.startswith("$") and _timestamp_clause(v)]
    if timestamps:
        rest = {k: v for k, v in query.items() if k not in timestamps}
        return all(_timestamp_matches(doc, k, query[k]) for k in timestamps) and matches(rest, doc)
    if "$where" in query:
        rest = {k: v for k, v in query.items() if k != "$where"}
        return compile_where(query["$where"])(doc) and matches(rest, doc)
    try:
        return _mongomock.filter_applies(query, doc)
    except CommandError:
        raise
    except NotImplementedError as exc:
        raise CommandError(2, f"unsupported query operator in the simulator: {exc}") from None
    except Exception as exc:  # mongomock reports bad queries with assorted exceptions
        raise CommandError(2, str(exc) or f"bad query: {bson_repr(query)}") from None


_FAST_SCALARS = (str, int, Int64, float, ObjectId)


def _scalar_matcher(field: str, value: Any) -> Callable[[dict[str, Any]], bool]:
    key = id_key(value)

    def match(doc: dict[str, Any]) -> bool:
        found = doc.get(field, _ABSENT)
        if type(found) is list:
            return any(type(e) in _FAST_SCALARS and id_key(e) == key for e in found)
        return type(found) in _FAST_SCALARS and id_key(found) == key

    return match


_ABSENT = object()


def compile_query(query: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
    """A matcher for ``query``: direct comparisons for top-level scalar equalities
    (the common case), mongomock's general matcher otherwise."""
    simple = all(
        not k.startswith("$") and "." not in k and type(v) in _FAST_SCALARS and v == v
        for k, v in query.items()
    )
    if not simple:
        if "$where" in query:
            where = compile_where(query["$where"])
            rest = compile_query({k: v for k, v in query.items() if k != "$where"})
            return lambda doc: rest(doc) and where(doc)
        check_operators(query)
        return functools.partial(_match_with, query)
    checks = [_scalar_matcher(k, v) for k, v in query.items()]
    return lambda doc: all(check(doc) for check in checks)


_UNKNOWN_OPERATOR = ("unknown operator:", "unknown top level operator:")


def check_operators(query: dict[str, Any]) -> None:
    """BadValue (2) for an unknown query operator, even when no document is there to match.

    mongod parses the whole filter before it reads (``MatchExpressionParser``), so
    ``{x: {$bad: 1}}`` fails on an empty or missing collection too. Matching an empty
    document finds the unknown operators; other errors it might raise are not mongod's
    (they depend on a document), so only those are reported here.
    """
    try:
        matches(query, {})
    except CommandError as err:
        if err.code == 2 and err.errmsg.startswith(_UNKNOWN_OPERATOR):
            raise


def _match_with(query: dict[str, Any], doc: dict[str, Any]) -> bool:
    return matches(query, doc)


def id_equality(query: dict[str, Any]) -> tuple[bool, Any]:
    """``(True, value)`` when ``query`` is exactly ``{_id: <value>}`` (a hashed lookup)."""
    if len(query) != 1 or "_id" not in query:
        return False, None
    value = query["_id"]
    if isinstance(value, dict):
        if len(value) == 1 and "$eq" in value:
            value = value["$eq"]
        elif any(k.startswith("$") for k in value):
            return False, None
    if isinstance(value, (list, Regex, re.Pattern, dict)):
        return (isinstance(value, dict) and not any(k.startswith("$") for k in value)), value
    return True, value
