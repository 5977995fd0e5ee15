"""Pipeline-style updates and projections: the ``$project`` evaluation is shared with
find projections (:func:`project`).
"""

from __future__ import annotations

from typing import Any

from bson.decimal128 import Decimal128

from ..core import _mongomock
from ..core.errors import CommandError
from ..storage import (
    bson_repr,
    copy_value,
    matches,
    path_values,
    type_name,
)
from .apply import positional_match
from .parse import _MISSING, _num_rank

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
        return _mongomock.evaluate(expr, doc)
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
    if not fields and "_id" in spec and include_id:
        inclusion = True  # {_id: 1} alone includes only _id (mongod's projection_policies)
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
    elif included and _is_flag(base.get("_id", 0)) and base.get("_id"):
        del base["_id"]  # {_id: 1, a: {$slice: n}}: all fields, ``a`` sliced (as without _id)
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


def _set_path(doc: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    target = doc
    for part in parts[:-1]:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    target[parts[-1]] = value
