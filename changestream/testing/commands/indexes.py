"""Index DDL: ``createIndexes`` (with 4.4+'s two-phase build entries when the collection
holds documents) and ``dropIndexes``, each logged one entry per index.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

from ..core.context import CommandContext
from ..core.errors import CommandError
from ..storage import (
    CollectionState,
    DuplicateKey,
    bson_repr,
    copy_value,
    type_name,
    values_equal,
)
from ..storage.sessions import WriteUnit
from .common import _check_fields, _find_index, _spec_text, collection_arg
from .ddl import create_collection
from .spec import command

_INDEX_OPTIONS = frozenset(
    {
        "v",
        "key",
        "name",
        "unique",
        "sparse",
        "partialFilterExpression",
        "expireAfterSeconds",
        "hidden",
        "collation",
        "background",
        "weights",
        "default_language",
        "language_override",
        "textIndexVersion",
        "2dsphereIndexVersion",
        "bits",
        "min",
        "max",
        "bucketSize",
        "storageEngine",
        "wildcardProjection",
        "prepareUnique",
        "ns",
        "dropDups",
    }
)
_INDEX_PLUGINS = frozenset({"text", "2d", "2dsphere", "geoHaystack", "hashed", "columnstore"})



# ======================================================================================
# Indexes
# ======================================================================================


def _normalize_index_spec(ctx: CommandContext, raw: Any, coll: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise CommandError(14, "The 'indexes' field must be an array of objects")
    key = raw.get("key")
    if not isinstance(key, dict) or not key:
        raise CommandError(
            9 if key is None else 67,
            "The 'key' field is a required property of an index specification"
            if key is None
            else f"Index keys cannot be an empty field: {bson_repr(raw)}",
        )
    for field, value in key.items():
        if not field:
            raise CommandError(
                67, "Index keys cannot be an empty field.", code_name="CannotCreateIndex"
            )
        if isinstance(value, str):
            if value not in _INDEX_PLUGINS:
                raise CommandError(
                    67, f"Unknown index plugin '{value}'", code_name="CannotCreateIndex"
                )
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CommandError(
                67,
                f"Values in v:2 index key pattern cannot be of type {type_name(value)}. Only "
                "numbers > 0, numbers < 0, and strings are allowed.",
                code_name="CannotCreateIndex",
            )
        elif value == 0:
            raise CommandError(
                67, "Values in v:2 index key pattern cannot be 0.", code_name="CannotCreateIndex"
            )
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise CommandError(9, "The 'name' field is a required property of an index specification")
    for option in raw:
        if option not in _INDEX_OPTIONS:
            raise CommandError(
                197,
                f"The field '{option}' is not valid for an index specification. Specification: "
                f"{bson_repr(raw)}",
                code_name="InvalidIndexSpecificationOption",
            )
    spec: dict[str, Any] = {"v": 2, "key": copy_value(key), "name": name}
    if ctx.deployment.profile.major_minor <= (4, 2):
        spec["ns"] = f"{ctx.db}.{coll}"
    for option, value in raw.items():
        # listIndexes shows `background` as given; `dropDups` is accepted and ignored
        # (index_key_validate.cpp: deprecated fields), as on mongod
        if option not in ("v", "key", "name", "ns", "dropDups"):
            spec[option] = copy_value(value)
    return spec


def _same_options(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def significant(spec: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in spec.items() if k not in ("v", "name", "ns", "background")}

    return values_equal(significant(a), significant(b))




@command("createIndexes", write=True)
def create_indexes(ctx: CommandContext) -> dict[str, Any]:
    name = collection_arg(ctx)
    _check_fields(
        ctx, ("indexes", "commitQuorum", "ignoreUnknownIndexOptions", "isTimeseriesNamespace")
    )
    raw_indexes = ctx.body.get("indexes")
    if not isinstance(raw_indexes, list):
        raise CommandError(
            40414 if raw_indexes is None else 14,
            "BSON field 'createIndexes.indexes' is missing but a required field"
            if raw_indexes is None
            else f"BSON field 'createIndexes.indexes' is the wrong type '{type_name(raw_indexes)}', "
            "expected type 'array'",
        )
    if not raw_indexes:
        raise CommandError(2, "Must specify at least one index to create")
    specs = [_normalize_index_spec(ctx, raw, name) for raw in raw_indexes]
    unit = WriteUnit.open(ctx, ddl=True)
    catalog = ctx.deployment.catalog
    state = catalog.get(ctx.db, name)
    if state is not None and state.is_view:
        raise CommandError(166, f"Cannot create indexes on a view: {state.ns}")
    created_automatically = state is None
    if state is None:
        state = create_collection(unit, ctx.db, name)
    before = len(state.indexes)
    to_build: list[dict[str, Any]] = []
    for spec in specs:
        if _index_exists(state, spec, to_build):
            continue
        to_build.append(spec)
    two_phase = (
        ctx.deployment.profile.two_phase_index_builds and not unit.in_transaction and len(state) > 0
    )
    if two_phase and to_build:
        _two_phase_index_build(unit, state, to_build)
    for spec in [] if two_phase else to_build:
        try:
            state.add_index(spec)
        except DuplicateKey as dup:
            raise dup.command_error() from None
        unit.on_undo(functools.partial(state.remove_index, spec["name"]))
        o: dict[str, Any] = {"createIndexes": state.name}
        o.update({k: copy_value(v) for k, v in spec.items() if k != "ns"})
        unit.log("c", f"{ctx.db}.$cmd", o, ui=state.uuid)
    reply: dict[str, Any] = {
        "numIndexesBefore": before,
        "numIndexesAfter": len(state.indexes),
        "createdCollectionAutomatically": created_automatically,
    }
    if not to_build:
        reply = {
            "numIndexesBefore": before,
            "numIndexesAfter": before,
            "note": "all indexes already exist",
        }
    return reply


def _two_phase_index_build(
    unit: WriteUnit, state: CollectionState, specs: list[dict[str, Any]]
) -> None:
    """Build indexes on a non-empty collection as mongod 4.4+ does (``IndexBuildsCoordinator``).

    One build for all ``specs``: ``startIndexBuild``, then ``commitIndexBuild``
    (the one ``createIndexes`` change event, listing every index), or
    ``abortIndexBuild`` with the cause when the data breaks a unique index.
    """
    cmd_ns = f"{state.db}.$cmd"
    build_uuid = uuid.uuid4()
    indexes = [{k: copy_value(v) for k, v in spec.items() if k != "ns"} for spec in specs]

    def entry(kind: str) -> dict[str, Any]:
        return {kind: state.name, "indexBuildUUID": build_uuid, "indexes": copy_value(indexes)}

    unit.log("c", cmd_ns, entry("startIndexBuild"), ui=state.uuid)
    built: list[str] = []
    try:
        for spec in specs:
            state.add_index(spec)
            built.append(spec["name"])
    except DuplicateKey as dup:
        for name in built:
            state.remove_index(name)
        error = dup.command_error()
        cause = {"ok": False, "code": error.code, "codeName": error.code_name,
                 "errmsg": error.errmsg, **error.extra}  # fmt: skip
        unit.log("c", cmd_ns, {**entry("abortIndexBuild"), "cause": cause}, ui=state.uuid)
        raise error from None
    unit.log("c", cmd_ns, entry("commitIndexBuild"), ui=state.uuid)


def _index_exists(
    state: CollectionState, spec: dict[str, Any], pending: list[dict[str, Any]]
) -> bool:
    """True when an identical index exists; IndexOptionsConflict/IndexKeySpecsConflict on clashes."""
    for existing in [*state.indexes, *pending]:
        same_name = existing["name"] == spec["name"]
        same_key = values_equal(existing["key"], spec["key"])
        if same_name and same_key:
            if _same_options(existing, spec):
                return True
            raise CommandError(
                85,
                "An equivalent index already exists with the same name but different options. "
                f"Requested index: {_spec_text(spec)}, existing index: {_spec_text(existing)}",
            )
        if same_name:
            raise CommandError(
                86,
                "An existing index has the same name as the requested index. When index names are "
                "not specified, they are auto generated and can cause conflicts. Please refer to "
                f"our documentation. Requested index: {_spec_text(spec)}, existing index: "
                f"{_spec_text(existing)}",
            )
        if same_key and _same_options(existing, spec):
            raise CommandError(
                85, f"Index already exists with a different name: {existing['name']}"
            )
    return False




@command("dropIndexes", "deleteIndexes", write=True)
def drop_indexes(ctx: CommandContext) -> dict[str, Any]:
    name = collection_arg(ctx)
    _check_fields(ctx, ("index", "isTimeseriesNamespace"))
    unit = WriteUnit.open(ctx, ddl=True)
    state = ctx.deployment.catalog.get(ctx.db, name)
    if state is None:
        raise CommandError(26, f"ns not found {ctx.db}.{name}")
    if state.is_view:
        raise CommandError(166, f"Namespace {state.ns} is a view, not a collection")
    selector = ctx.body.get("index")
    if selector is None:
        raise CommandError(40414, "BSON field 'dropIndexes.index' is missing but a required field")
    before = len(state.indexes)
    if selector == "*":
        targets = [spec for spec in state.indexes if spec["name"] != "_id_"]
    elif isinstance(selector, list):
        targets = [_find_index(state, s) for s in selector]
    elif isinstance(selector, (str, dict)):
        targets = [_find_index(state, selector)]
    else:
        raise CommandError(
            14,
            f"BSON field 'dropIndexes.index' is the wrong type '{type_name(selector)}', expected "
            "types '[string, object, array]'",
        )
    if any(spec["name"] == "_id_" for spec in targets):
        raise CommandError(72, "cannot drop _id index", code_name="InvalidOptions")
    for spec in targets:
        state.remove_index(spec["name"])
        unit.on_undo(functools.partial(state.add_index, spec))
        o2 = {k: copy_value(v) for k, v in spec.items() if k != "ns"}
        unit.log(
            "c",
            f"{ctx.db}.$cmd",
            {"dropIndexes": state.name, "index": spec["name"]},
            ui=state.uuid,
            o2=o2,
        )
    return {"nIndexesWas": before}




