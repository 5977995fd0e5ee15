"""Evaluate the user stages that follow ``$changeStream`` on each change event.

mongod only allows document-at-a-time stages after ``$changeStream``
(``$match``, ``$project``, ``$addFields``/``$set``, ``$unset``,
``$replaceRoot``/``$replaceWith``, ``$redact``). Each stage is compiled once
into a function ``event -> event | None`` (None: filtered out), so the per-event
cost is one call per stage. Query matching and expression operators come from
mongomock; projection semantics (output field order, dotted and nested paths,
computed sub-documents) follow mongod's ``ProjectionNode``. Stages never mutate
their input: events share sub-documents with the oplog.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from bson.binary import Binary
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from ..core import _mongomock
from ..core._mongomock import OperationFailure
from ..core.errors import CommandError
from ..storage.order import type_name as bson_type_name

Doc = dict[str, Any]
StageFn = Callable[[Doc], "Doc | None"]

MISSING: Final = object()
"""An expression that evaluated to nothing (a missing field)."""

PER_DOCUMENT_STAGES: Final = frozenset(
    {
        "$match",
        "$project",
        "$addFields",
        "$set",
        "$unset",
        "$replaceRoot",
        "$replaceWith",
        "$redact",
    }
)
"""The stages this module evaluates (all that mongod allows in a change stream)."""

_filter_applies = _mongomock.filter_applies

_KEEP: Final = "$$KEEP"
_PRUNE: Final = "$$PRUNE"
_DESCEND: Final = "$$DESCEND"
_REDACT_VARS: Final = {"KEEP": _KEEP, "PRUNE": _PRUNE, "DESCEND": _DESCEND}

_KNOWN_OPERATORS: Final = _mongomock.KNOWN_OPERATORS | {"$mergeObjects"}


# -- formatting helpers shared with the rest of the change-stream engine ---------------------------
def type_name(value: Any) -> str:
    """mongod's ``typeName()`` for the BSON type ``value`` encodes to (``missing`` if absent)."""
    return "missing" if value is MISSING else bson_type_name(value)


def value_to_string(value: Any) -> str:
    """A value as mongod's ``Value::toString`` prints it (used in error messages)."""
    if isinstance(value, Mapping):
        inner = ", ".join(f"{k}: {value_to_string(v)}" for k, v in value.items())
        return "{" + inner + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_to_string(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Timestamp):
        return f"Timestamp({value.time}, {value.inc})"
    if isinstance(value, uuid.UUID):
        return f'UUID("{value}")'
    if isinstance(value, ObjectId):
        return f'ObjectId("{value}")'
    if isinstance(value, (bytes, Binary)):
        subtype = value.subtype if isinstance(value, Binary) else 0
        return f"BinData({subtype}, {bytes(value).hex().upper()})"
    if isinstance(value, datetime.datetime):
        return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"
    if isinstance(value, Int64):
        return str(int(value))
    return str(value)


# -- expressions ---------------------------------------------------------------------------------
def _merge_objects(parse: Callable[[Any], Any], args: Any) -> dict[str, Any]:
    """``$mergeObjects``, which mongomock's evaluator lacks."""
    merged: dict[str, Any] = {}
    for arg in args if isinstance(args, list) else [args]:
        try:
            value = parse(arg)
        except KeyError:
            continue
        if value is None:
            continue
        if not isinstance(value, dict):
            raise CommandError(
                40400,
                f"$mergeObjects requires object inputs, but input {value_to_string(value)} "
                f"is of type {type_name(value)}",
            )
        merged.update(value)
    return merged


_EXTRA_OPERATORS: Final[Mapping[str, _mongomock.ExtraOperator]] = {"$mergeObjects": _merge_objects}


def _eval_error(exc: Exception) -> CommandError:
    msg = str(exc)
    if "Unrecognized expression" in msg:
        return CommandError(168, msg)
    return CommandError(2, msg)


def evaluate(
    expr: Any, current: Doc, root: Doc | None = None, variables: Mapping[str, Any] | None = None
) -> Any:
    """Evaluate aggregation expression ``expr`` against ``current`` (``MISSING`` if absent)."""
    if isinstance(expr, str):
        if not expr.startswith("$"):
            return expr
        if not expr.startswith("$$"):
            value: Any = current
            for part in expr[1:].split("."):
                if isinstance(value, dict):
                    value = value.get(part, MISSING)
                    if value is MISSING:
                        return MISSING
                elif isinstance(value, list):
                    break  # array traversal: let mongomock apply its rules
                else:
                    return MISSING
            else:
                return value
    elif isinstance(expr, list):
        return [
            None if (v := evaluate(e, current, root, variables)) is MISSING else v for e in expr
        ]
    elif not isinstance(expr, dict):
        return expr
    user_vars: dict[str, Any] = dict(variables or {})
    if root is not None and root is not current:
        user_vars["ROOT"] = root
    try:
        return _mongomock.evaluate(expr, current, user_vars=user_vars, extra=_EXTRA_OPERATORS)
    except KeyError:
        return MISSING
    except (OperationFailure, NotImplementedError, TypeError, ValueError) as exc:
        raise _eval_error(exc) from exc


def _check_expression(expr: Any) -> None:
    """Reject unknown ``$operators`` at parse time, as mongod does."""
    if isinstance(expr, list):
        for item in expr:
            _check_expression(item)
    elif isinstance(expr, dict):
        for key, value in expr.items():
            if key.startswith("$") and key not in _KNOWN_OPERATORS:
                raise CommandError(168, f"Unrecognized expression '{key}'")
            _check_expression(value)


def _is_expression_object(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and next(iter(value)).startswith("$")


# -- projection trees ------------------------------------------------------------------------------
@dataclass(slots=True)
class _Node:
    """One level of a projection (mongod's ``ProjectionNode``)."""

    paths: set[str] = field(default_factory=set)
    """Fields included (inclusion) or removed (exclusion) at this level."""
    children: dict[str, _Node] = field(default_factory=dict)
    computed: dict[str, Any] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    """Computed fields and children, in specification order."""
    has_computed: bool = False

    def child(self, name: str, where: str, stage: str) -> _Node:
        if name in self.paths or name in self.computed:
            raise CommandError(31250, f"Invalid {stage} :: caused by :: Path collision at {where}")
        node = self.children.get(name)
        if node is None:
            node = self.children[name] = _Node()
            self.order.append(name)
        return node

    def leaf(self, name: str, where: str, stage: str) -> None:
        if name in self.children or name in self.paths or name in self.computed:
            raise CommandError(31250, f"Invalid {stage} :: caused by :: Path collision at {where}")

    def mark_computed(self) -> None:
        self.has_computed = True


def _field_parts(path: str, stage: str) -> list[str]:
    parts = path.split(".")
    for part in parts:
        if not part:
            raise CommandError(
                40352,
                f"Invalid {stage} :: caused by :: FieldPath cannot be constructed with empty string",
            )
        if part.startswith("$"):
            raise CommandError(
                16410,
                f"Invalid {stage} :: caused by :: FieldPath field names may not start with '$'. Consider using $getField or $setField.",
            )
    return parts


class _ProjectionBuilder:
    """Parses a ``$project``/``$addFields`` specification into a :class:`_Node` tree."""

    def __init__(self, stage: str, literals_only_computed: bool) -> None:
        self.stage = stage
        self.addfields = literals_only_computed
        self.root = _Node()
        self.inclusions: list[str] = []
        self.exclusions: list[str] = []
        self.computed: list[str] = []
        self.id_excluded = False
        self.id_mentioned = False

    def add_spec(self, spec: Mapping[str, Any], prefix: list[str]) -> None:
        for key, value in spec.items():
            parts = prefix + _field_parts(key, self.stage)
            if isinstance(value, dict) and not _is_expression_object(value):
                if not value:
                    raise CommandError(
                        51270,
                        f"Invalid {self.stage} :: caused by :: An empty sub-projection is not a "
                        f"valid value. Found empty object at path",
                    )
                self.add_spec(value, parts)
            else:
                self.add_leaf(parts, value)

    def add_leaf(self, parts: list[str], value: Any) -> None:
        path = ".".join(parts)
        node = self.root
        for depth, name in enumerate(parts[:-1]):
            node = node.child(name, ".".join(parts[: depth + 1]), self.stage)
        name = parts[-1]
        node.leaf(name, path, self.stage)
        is_flag = isinstance(value, (bool, int, float, Int64, Decimal128))
        if is_flag and not self.addfields:
            truthy = bool(value.to_decimal()) if isinstance(value, Decimal128) else bool(value)
            if path == "_id":
                self.id_mentioned = True
                self.id_excluded = not truthy
                return
            (self.inclusions if truthy else self.exclusions).append(path)
            node.paths.add(name)
            return
        _check_expression(value)
        if path == "_id":
            self.id_mentioned = True
        self.computed.append(path)
        node.computed[name] = value
        node.order.append(name)
        self._mark_computed(parts)

    def _mark_computed(self, parts: list[str]) -> None:
        node = self.root
        node.mark_computed()
        for name in parts[:-1]:
            node = node.children[name]
            node.mark_computed()


# -- applying trees ----------------------------------------------------------------------------------
def _include_value(node: _Node, value: Any) -> Any:
    if isinstance(value, dict):
        return _include(node, value)
    if isinstance(value, list):
        return [_include_value(node, item) for item in value if isinstance(item, (dict, list))]
    return MISSING


def _include(node: _Node, doc: Doc) -> Doc:
    out: Doc = {}
    paths = node.paths
    children = node.children
    for key, value in doc.items():
        if key in paths:
            out[key] = value
        elif key in children:
            projected = _include_value(children[key], value)
            if projected is not MISSING:
                out[key] = projected
    return out


def _apply_expressions(node: _Node, out: Doc, root: Doc) -> None:
    """Evaluate ``node``'s computed fields into ``out`` (in specification order)."""
    for name in node.order:
        expr = node.computed.get(name, MISSING)
        if expr is not MISSING:
            value = evaluate(expr, root)
            if value is MISSING:
                out.pop(name, None)
            else:
                out[name] = value
            continue
        child = node.children[name]
        if child.has_computed:
            out[name] = _expressions_into(child, out.get(name, MISSING), root)


def _expressions_into(node: _Node, value: Any, root: Doc) -> Any:
    if isinstance(value, list):
        return [_expressions_into(node, item, root) for item in value]
    sub: Doc = dict(value) if isinstance(value, dict) else {}
    _apply_expressions(node, sub, root)
    return sub


def _exclude_value(node: _Node, value: Any) -> Any:
    if isinstance(value, dict):
        return _exclude(node, value)
    if isinstance(value, list):
        return [_exclude_value(node, item) for item in value]
    return value


def _exclude(node: _Node, doc: Doc) -> Doc:
    out: Doc = {}
    paths = node.paths
    children = node.children
    for key, value in doc.items():
        if key in paths:
            continue
        out[key] = _exclude_value(children[key], value) if key in children else value
    return out


# -- stage compilers -----------------------------------------------------------------------------------
def _compile_match(spec: Any) -> StageFn:
    if not isinstance(spec, dict):
        raise CommandError(15959, "the match filter must be an expression in an object")
    needs_patch = _needs_normalising(spec)
    query = _normalise(spec) if needs_patch else spec
    _check_match(query)
    if spec and all(isinstance(v, str) and not k.startswith("$") for k, v in spec.items()):
        return _string_equality_match(spec, query)

    def match(doc: Doc) -> Doc | None:
        target = _normalise(doc) if needs_patch else doc
        try:
            return doc if _filter_applies(query, target) else None
        except (OperationFailure, NotImplementedError, TypeError, ValueError) as exc:
            raise CommandError(2, str(exc)) from exc

    return match


def _string_equality_match(spec: Doc, query: Doc) -> StageFn:
    """``{path: "string", ...}`` (the usual change-stream filter) without mongomock's overhead.

    Paths that cross an array fall back to mongomock, which knows its semantics.
    """
    tests = [(key.split("."), value) for key, value in spec.items()]

    def match(doc: Doc) -> Doc | None:
        for parts, expected in tests:
            value: Any = doc
            for part in parts:
                if not isinstance(value, dict):
                    if isinstance(value, list):
                        return doc if _filter_applies(query, doc) else None
                    return None
                value = value.get(part, MISSING)
            if isinstance(value, list):
                return doc if _filter_applies(query, doc) else None
            if value != expected or not isinstance(value, str):
                return None
        return doc

    return match


def _check_match(query: Doc) -> None:
    """Surface malformed filters when the stage is parsed, not on the first event."""
    try:
        _filter_applies(query, {})
    except (OperationFailure, NotImplementedError, TypeError, ValueError) as exc:
        raise CommandError(2, str(exc)) from exc


def _needs_normalising(value: Any) -> bool:
    if isinstance(value, (datetime.datetime, Timestamp)):
        return True
    if isinstance(value, dict):
        return any(_needs_normalising(v) for v in value.values())
    if isinstance(value, list):
        return any(_needs_normalising(v) for v in value)
    return False


def _normalise(value: Any) -> Any:
    """Values mongomock can compare: naive UTC datetimes, Timestamps as ordered integers."""
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    if isinstance(value, Timestamp):
        return (value.time << 32) | value.inc
    if isinstance(value, datetime.datetime) and value.tzinfo is not None:
        offset = value.utcoffset() or datetime.timedelta()
        return (value - offset).replace(tzinfo=None)
    return value


def _compile_project(spec: Any) -> StageFn:
    if not isinstance(spec, dict):
        raise CommandError(15969, "$project specification must be an object")
    if not spec:
        raise CommandError(
            51272,
            "Invalid $project :: caused by :: projection specification must have at least one field",
        )
    builder = _ProjectionBuilder("$project", literals_only_computed=False)
    builder.add_spec(spec, [])
    root = builder.root
    if builder.exclusions:
        if builder.inclusions:
            raise CommandError(
                31254,
                f"Invalid $project :: caused by :: Cannot do exclusion on field {builder.exclusions[0]} "
                "in inclusion projection",
            )
        if builder.computed:
            raise CommandError(
                31252,
                "Invalid $project :: caused by :: Cannot use expression other than $meta in "
                "exclusion projection",
            )
    inclusion = bool(builder.inclusions or builder.computed) or (
        builder.id_mentioned and not builder.id_excluded and not builder.exclusions
    )
    if not inclusion:
        if builder.id_excluded:
            root.paths.add("_id")

        def exclude(doc: Doc) -> Doc | None:
            return _exclude(root, doc)

        return exclude
    if not builder.id_excluded and "_id" not in root.computed and "_id" not in root.children:
        root.paths.add("_id")

    def include(doc: Doc) -> Doc | None:
        out = _include(root, doc)
        if root.has_computed:
            _apply_expressions(root, out, doc)
        return out

    return include


def _compile_add_fields(spec: Any, stage: str) -> StageFn:
    if not isinstance(spec, dict):
        raise CommandError(
            40272, f"{stage} specification stage must be an object, got {type_name(spec)}"
        )
    if not spec:
        raise CommandError(
            51272, f"Invalid {stage} :: caused by :: specification must have at least one field"
        )
    builder = _ProjectionBuilder(stage, literals_only_computed=True)
    builder.add_spec(spec, [])
    root = builder.root

    def add_fields(doc: Doc) -> Doc | None:
        out = dict(doc)
        _apply_expressions(root, out, doc)
        return out

    return add_fields


def _compile_unset(spec: Any) -> StageFn:
    paths = [spec] if isinstance(spec, str) else spec
    if not isinstance(paths, list):
        raise CommandError(31002, "$unset specification must be a string or an array")
    if not paths:
        raise CommandError(
            31119, "$unset specification must be a string or an array with at least one field"
        )
    if not all(isinstance(p, str) for p in paths):
        raise CommandError(
            31120, "$unset specification must be a string or an array containing only string values"
        )
    return _compile_project(dict.fromkeys(paths, 0))


def _compile_replace_root(spec: Any, stage: str) -> StageFn:
    if stage == "$replaceRoot":
        if not isinstance(spec, dict):
            raise CommandError(
                40228,
                f"expected an object as specification for $replaceRoot stage, got {type_name(spec)}",
            )
        for key in spec:
            if key != "newRoot":
                raise CommandError(40415, f"BSON field '$replaceRoot.{key}' is an unknown field.")
        if "newRoot" not in spec:
            raise CommandError(
                40414, "BSON field '$replaceRoot.newRoot' is missing but a required field"
            )
        expr = spec["newRoot"]
    else:
        expr = spec
    _check_expression(expr)

    def replace_root(doc: Doc) -> Doc | None:
        value = evaluate(expr, doc)
        if not isinstance(value, dict):
            raise CommandError(
                40228,
                "'newRoot' expression must evaluate to an object, but resulting value was: "
                f"{'MISSING' if value is MISSING else value_to_string(value)}. Type of resulting "
                f"value: '{type_name(value)}'. Input document: {value_to_string(doc)}",
            )
        return value

    return replace_root


def _compile_redact(spec: Any) -> StageFn:
    _check_expression(spec)

    def decide(current: Doc, root: Doc) -> Any:
        verdict = evaluate(spec, current, root, _REDACT_VARS)
        if verdict not in (_KEEP, _PRUNE, _DESCEND):
            raise CommandError(
                17053,
                "$redact's expression should not return anything aside from the variables $$KEEP, "
                f"$$DESCEND, and $$PRUNE, but returned {value_to_string(verdict)}",
            )
        return verdict

    def descend_value(value: Any, root: Doc) -> Any:
        if isinstance(value, dict):
            return redact(value, root)
        if isinstance(value, list):
            kept = (descend_value(item, root) for item in value)
            return [item for item in kept if item is not MISSING]
        return value

    def redact(current: Doc, root: Doc) -> Any:
        verdict = decide(current, root)
        if verdict == _KEEP:
            return current
        if verdict == _PRUNE:
            return MISSING
        out: Doc = {}
        for key, value in current.items():
            kept = descend_value(value, root)
            if kept is not MISSING:
                out[key] = kept
        return out

    def apply(doc: Doc) -> Doc | None:
        result = redact(doc, doc)
        return None if result is MISSING else result

    return apply


def compile_stage(name: str, spec: Any) -> StageFn:
    """Compile one per-document stage; raises :class:`CommandError` as mongod's parser does."""
    if name == "$match":
        return _compile_match(spec)
    if name == "$project":
        return _compile_project(spec)
    if name in ("$addFields", "$set"):
        return _compile_add_fields(spec, name)
    if name == "$unset":
        return _compile_unset(spec)
    if name in ("$replaceRoot", "$replaceWith"):
        return _compile_replace_root(spec, name)
    if name == "$redact":
        return _compile_redact(spec)
    raise ValueError(f"{name} is not a per-document stage")


class Pipeline:
    """The user's stages compiled into a chain of per-document functions."""

    __slots__ = ("_stages",)

    def __init__(self, stages: Iterable[Mapping[str, Any]]) -> None:
        self._stages: tuple[StageFn, ...] = tuple(
            compile_stage(name, spec) for stage in stages for name, spec in stage.items()
        )

    def __bool__(self) -> bool:
        return bool(self._stages)

    def apply(self, doc: Doc) -> Doc | None:
        """Run ``doc`` through every stage; None if a stage dropped it."""
        for stage in self._stages:
            result = stage(doc)
            if result is None:
                return None
            doc = result
        return doc
