"""A ``$match`` on change-event fields, evaluated client-side (for the hub's subscribers).

The hub runs one server-side stream for many subscribers, so each subscriber's
filter runs here, on the events as received. Only a documented subset of the
query language is understood; anything else is refused when the filter is
compiled, with one :class:`ValueError` naming the operator and the supported
ones (never a silent mismatch):

* field paths with dots (``"ns.coll"``, ``"fullDocument.status"``), matching
  into arrays as the server does for equality (an array field equals a value
  it contains);
* a plain value: equality;
* ``$eq``, ``$ne``, ``$gt``, ``$gte``, ``$lt``, ``$lte``, ``$in``, ``$nin``,
  ``$exists``, ``$not`` (over an operator document);
* ``$and``, ``$or``, ``$nor`` at the top level or nested.

Comparisons apply to values of comparable Python types only (numbers with
numbers, strings with strings, datetimes with datetimes, ...); mixing types
never matches, as BSON's type-bracketed comparison would not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["SUPPORTED", "compile_match"]

Predicate = Callable[[Any], bool]

_MISSING = object()

SUPPORTED = (
    "$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$exists", "$not",
    "$and", "$or", "$nor",
)
"""The operators :func:`compile_match` understands."""


def _refuse(what: str) -> ValueError:
    return ValueError(
        f"match: {what} is not supported client-side; supported: {', '.join(SUPPORTED)} "
        f"on dotted event field paths (or pass a Python predicate as where=)"
    )


def _get(document: Any, path: Sequence[str]) -> Any:
    value = document
    for part in path:
        if isinstance(value, Mapping):
            value = value.get(part, _MISSING)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
        if value is _MISSING:
            return _MISSING
    return value


def _equals(value: Any, wanted: Any) -> bool:
    if value is _MISSING:
        return wanted is None
    if _same(value, wanted):
        return True
    return isinstance(value, list) and not isinstance(wanted, list) and any(
        _same(item, wanted) for item in value
    )


def _same(value: Any, wanted: Any) -> bool:
    """BSON equality: ``True`` is not ``1``."""
    if (type(value) is bool) is not (type(wanted) is bool):
        return False
    return bool(value == wanted)


def _compare(op: str, value: Any, bound: Any) -> bool:
    if value is _MISSING or value is None:
        return False
    try:
        if op == "$gt":
            return bool(value > bound)
        if op == "$gte":
            return bool(value >= bound)
        if op == "$lt":
            return bool(value < bound)
        return bool(value <= bound)
    except TypeError:
        return False  # different BSON types never compare


def _operator(op: str, argument: Any) -> Callable[[Any], bool]:
    if op == "$eq":
        return lambda v: _equals(v, argument)
    if op == "$ne":
        return lambda v: not _equals(v, argument)
    if op in ("$gt", "$gte", "$lt", "$lte"):
        return lambda v: _compare(op, v, argument)
    if op in ("$in", "$nin"):
        if not isinstance(argument, (list, tuple)):
            raise ValueError(f"match: {op} needs a list, not {argument!r}")
        choices = list(argument)
        if op == "$in":
            return lambda v: any(_equals(v, c) for c in choices)
        return lambda v: not any(_equals(v, c) for c in choices)
    if op == "$exists":
        wanted = bool(argument)
        return lambda v: (v is not _MISSING) is wanted
    if op == "$not":
        if not isinstance(argument, Mapping) or not argument:
            raise ValueError(f"match: $not needs an operator document, not {argument!r}")
        inner = _field_test(argument)
        return lambda v: not inner(v)
    raise _refuse(f"the operator {op!r}")


def _field_test(condition: Any) -> Callable[[Any], bool]:
    """What a field's value must satisfy: an operator document, or equality."""
    if isinstance(condition, Mapping) and condition and all(
        isinstance(k, str) and k.startswith("$") for k in condition
    ):
        tests = [_operator(op, arg) for op, arg in condition.items()]
        return lambda v: all(test(v) for test in tests)
    if isinstance(condition, Mapping) and any(
        isinstance(k, str) and k.startswith("$") for k in condition
    ):
        raise ValueError(f"match: mixes operators and fields in {dict(condition)!r}")
    return lambda v: _equals(v, condition)


def _combine(op: str, parts: list[Predicate]) -> Predicate:
    if op == "$and":
        return lambda e: all(p(e) for p in parts)
    if op == "$or":
        return lambda e: any(p(e) for p in parts)
    return lambda e: not any(p(e) for p in parts)


def _on_path(path: list[str], test: Callable[[Any], bool]) -> Predicate:
    return lambda e: test(_get(e, path))


def compile_match(match: Mapping[str, Any]) -> Predicate:
    """A predicate for ``match`` (see the module docstring); raises ``ValueError`` when refused."""
    if not isinstance(match, Mapping):
        raise ValueError(f"match must be a document (a dict), not {type(match).__name__}")
    tests: list[Predicate] = []
    for key, condition in match.items():
        if not isinstance(key, str):
            raise ValueError(f"match: field names are strings, not {key!r}")
        if key in ("$and", "$or", "$nor"):
            if not isinstance(condition, (list, tuple)) or not condition:
                raise ValueError(f"match: {key} needs a non-empty list of documents")
            tests.append(_combine(key, [compile_match(part) for part in condition]))
        elif key.startswith("$"):
            raise _refuse(f"the top-level operator {key!r}")
        else:
            tests.append(_on_path(key.split("."), _field_test(condition)))
    if len(tests) == 1:
        return tests[0]
    return lambda e: all(t(e) for t in tests)
