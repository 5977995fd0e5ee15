"""Collection, view, index and database DDL commands, and the listing commands.

Every DDL write logs the command entry mongod logs (``ns = "db.$cmd"``, the
collection UUID in ``ui``), in mongod's order: a collection created
implicitly by a write is logged before the write; ``dropDatabase`` logs one
``drop`` per collection, then ``dropDatabase``; a rename that replaces its
target records the dropped target's UUID in ``dropTarget`` instead of logging
a separate drop; ``createIndexes`` logs one entry per index (one
``startIndexBuild`` / ``commitIndexBuild`` pair for all of them when the
collection holds documents, 4.4+), ``dropIndexes`` one entry per index.
Views have no UUID and no ``create`` entry: as in mongod, creating, modifying
and dropping a view is logged only as an insert, replacement or delete of its
document in ``db.system.views`` (whose own creation is logged once).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import bson
from bson.binary import UuidRepresentation
from bson.codec_options import CodecOptions

from ..cursors import CursorBatch, cursor_reply
from ..errors import CommandError
from ..storage import (
    Catalog,
    CollectionState,
    DuplicateKey,
    bson_repr,
    check_collection_name,
    check_db_name,
    copy_value,
    id_key,
    matches,
    type_name,
    values_equal,
)
from . import CommandContext, command
from .transactions import WriteUnit

GENERIC_ARGS = frozenset(
    {
        "$db",
        "lsid",
        "txnNumber",
        "autocommit",
        "startTransaction",
        "writeConcern",
        "readConcern",
        "$readPreference",
        "$clusterTime",
        "comment",
        "maxTimeMS",
        "apiVersion",
        "apiStrict",
        "apiDeprecationErrors",
        "$audit",
        "$client",
        "mayBypassWriteBlocking",
        "stmtId",
        "stmtIds",
        "$configServerState",
        "$topologyTime",
        "databaseVersion",
        "shardVersion",
    }
)
"""Arguments every command accepts (mongod's generic arguments)."""

_CREATE_OPTION_ORDER = (
    "capped",
    "size",
    "max",
    "autoIndexId",
    "temp",
    "recordPreImages",
    "changeStreamPreAndPostImages",
    "storageEngine",
    "indexOptionDefaults",
    "validator",
    "validationLevel",
    "validationAction",
    "collation",
    "clusteredIndex",
    "expireAfterSeconds",
    "viewOn",
    "pipeline",
    "timeseries",
    "encryptedFields",
)
"""``CollectionOptions::appendBSON`` order, used in oplog ``create`` entries and listings."""

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
    }
)
_INDEX_PLUGINS = frozenset({"text", "2d", "2dsphere", "geoHaystack", "hashed", "columnstore"})

MAX_BATCH_BYTES = 16 * 1024 * 1024
_SIZE_OPTIONS: CodecOptions[dict[str, Any]] = CodecOptions(
    uuid_representation=UuidRepresentation.STANDARD
)


# ======================================================================================
# Cursors over materialized results (find, listCollections, listIndexes)
# ======================================================================================


def lsid_bytes(ctx: CommandContext) -> bytes | None:
    """``lsid.id`` of the command as raw bytes (cursors remember their session)."""
    ident = (ctx.lsid or {}).get("id")
    if ident is None:
        return None
    return ident.bytes if hasattr(ident, "bytes") and not isinstance(ident, bytes) else bytes(ident)


class ListCursor:
    """A non-tailable cursor over a precomputed list of documents."""

    tailable_await = False

    def __init__(self, ns: str, docs: list[dict[str, Any]], lsid_id: bytes | None) -> None:
        self.ns = ns
        self.lsid_id = lsid_id
        self._docs = docs
        self._pos = 0

    def next_batch(self, batch_size: int | None) -> CursorBatch:
        """Up to ``batch_size`` documents (None: as many as fit in 16 MB)."""
        docs = self._docs
        limit = len(docs) if batch_size is None else min(len(docs), self._pos + batch_size)
        out: list[dict[str, Any]] = []
        size = 0
        while self._pos < limit:
            doc = docs[self._pos]
            size += len(bson.encode(doc, codec_options=_SIZE_OPTIONS))
            if out and size > MAX_BATCH_BYTES:
                break
            out.append(doc)
            self._pos += 1
        return CursorBatch(out, exhausted=self._pos >= len(docs))

    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch:
        return self.next_batch(batch_size)

    def close(self) -> None:
        self._docs = []


def batch_size_arg(value: Any, command_name: str, default: int | None) -> int | None:
    """Validate a ``batchSize`` (``cursor.batchSize`` or find's own)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CommandError(
            14,
            f"BSON field '{command_name}.batchSize' is the wrong type '{type_name(value)}', "
            "expected types '[long, int, decimal, double]'",
        )
    if value < 0:
        raise CommandError(
            51024, f"BSON field 'batchSize' value must be >= 0, actual value '{int(value)}'"
        )
    return int(value)


def open_cursor(
    ctx: CommandContext,
    ns: str,
    docs: list[dict[str, Any]],
    batch_size: int | None,
    *,
    single_batch: bool = False,
) -> dict[str, Any]:
    """Reply with a first batch; register the cursor when documents remain."""
    cursor = ListCursor(ns, docs, lsid_bytes(ctx))
    batch = cursor.next_batch(batch_size)
    if single_batch:
        batch.exhausted = True
    cid = 0
    if not batch.exhausted:
        cid = ctx.deployment.cursors.register(cursor, ctx.member.name)
    return cursor_reply(cid, ns, batch, first=True)


def _cursor_options(ctx: CommandContext) -> int | None:
    spec = ctx.body.get("cursor", {})
    if not isinstance(spec, dict):
        raise CommandError(
            14,
            f"BSON field '{ctx.name}.cursor' is the wrong type '{type_name(spec)}', expected type "
            "'object'",
        )
    return batch_size_arg(spec.get("batchSize"), "cursor", None)


# ======================================================================================
# Creating collections (explicitly, implicitly by writes, and views)
# ======================================================================================


def canonical_options(options: dict[str, Any]) -> dict[str, Any]:
    """Create options in mongod's order (disabled pre/post images are omitted)."""
    out: dict[str, Any] = {}
    for name in _CREATE_OPTION_ORDER:
        if name not in options:
            continue
        value = options[name]
        if name == "changeStreamPreAndPostImages" and not (
            isinstance(value, dict) and value.get("enabled")
        ):
            continue
        if name == "pipeline" and not value:
            continue
        out[name] = copy_value(value)
    for name, value in options.items():
        if name not in out and name not in _CREATE_OPTION_ORDER and name != "idIndex":
            out[name] = copy_value(value)
    return out


def create_collection(
    unit: WriteUnit, db: str, name: str, options: dict[str, Any] | None = None
) -> CollectionState:
    """Create ``db.name`` (or a view) and log its ``create`` entry."""
    catalog = unit.ctx.deployment.catalog
    options = options or {}
    is_view = "viewOn" in options
    if is_view and catalog.get(db, "system.views") is None:
        create_collection(unit, db, "system.views")
    state = catalog.new_collection(db, name, options)
    unit.on_undo(lambda: catalog.detach(state.db, state.name))
    if is_view:
        _sync_view_definition(unit, catalog, state)
        return state
    o: dict[str, Any] = {"create": name, **canonical_options(options)}
    o["idIndex"] = copy_value(state.indexes[0])
    unit.log("c", f"{db}.$cmd", o, ui=state.uuid)
    return state


def _sync_view_definition(
    unit: WriteUnit | None, catalog: Catalog, view: CollectionState, *, remove: bool = False
) -> None:
    """Mirror a view's definition into ``db.system.views``, as mongod stores views.

    With a ``unit``, the change is logged as mongod logs it (an insert, a
    replacement or a delete of the ``system.views`` document,
    ``{_id: "db.view", viewOn, pipeline[, collation]}``): that is the only
    trace views leave in the oplog, and what change streams turn into view
    ``create``/``modify``/``drop`` events.
    """
    views = catalog.get(view.db, "system.views")
    if views is None:
        return
    key = id_key(view.ns)
    old = views.lookup(key)
    if old is not None:
        views.remove(key)
        if unit is not None:
            unit.on_undo(functools.partial(views.insert, old))
    if remove:
        if old is not None and unit is not None:
            unit.log("d", views.ns, {"_id": view.ns}, ui=views.uuid)
        return
    doc: dict[str, Any] = {
        "_id": view.ns,
        "viewOn": view.options["viewOn"],
        "pipeline": copy_value(view.options.get("pipeline", [])),
    }
    if "collation" in view.options:
        doc["collation"] = copy_value(view.options["collation"])
    views.insert(doc)
    if unit is not None:
        unit.on_undo(functools.partial(views.remove, key))
        op = "u" if old is not None else "i"
        unit.log(op, views.ns, copy_value(doc), ui=views.uuid, o2={"_id": view.ns})


def ensure_collection(unit: WriteUnit, db: str, name: str) -> CollectionState:
    """The collection a write targets, created implicitly (and logged) when missing."""
    state = unit.ctx.deployment.catalog.get(db, name)
    if state is None:
        check_collection_name(db, name)
        state = create_collection(unit, db, name)
    return state


def collection_arg(ctx: CommandContext) -> str:
    """The command's collection name (its first value), validated."""
    name = ctx.target
    if not isinstance(name, str):
        raise CommandError(
            73,
            f"collection name has invalid type {type_name(name)}",
            code_name="InvalidNamespace",
        )
    check_collection_name(ctx.db, name)
    return name


def _check_fields(ctx: CommandContext, allowed: Iterable[str]) -> None:
    known = set(allowed) | GENERIC_ARGS | {ctx.name}
    for name in ctx.body:
        if name not in known:
            raise CommandError(40415, f"BSON field '{ctx.name}.{name}' is an unknown field.")


_CREATE_FIELDS = (
    "capped",
    "autoIndexId",
    "idIndex",
    "size",
    "max",
    "storageEngine",
    "validator",
    "validationLevel",
    "validationAction",
    "indexOptionDefaults",
    "viewOn",
    "pipeline",
    "collation",
    "changeStreamPreAndPostImages",
    "recordPreImages",
    "timeseries",
    "clusteredIndex",
    "expireAfterSeconds",
    "encryptedFields",
    "temp",
    "flags",
)


def _validate_create_options(ctx: CommandContext, options: dict[str, Any]) -> None:
    profile = ctx.deployment.profile
    if "changeStreamPreAndPostImages" in options:
        if not profile.pre_post_images:
            raise CommandError(
                40415, f"BSON field '{ctx.name}.changeStreamPreAndPostImages' is an unknown field."
            )
        images = options["changeStreamPreAndPostImages"]
        if not isinstance(images, dict) or set(images) != {"enabled"}:
            raise CommandError(
                40414,
                f"BSON field '{ctx.name}.changeStreamPreAndPostImages.enabled' is missing but a "
                "required field",
            )
    for name in ("validator", "storageEngine", "indexOptionDefaults", "collation"):
        if name in options and not isinstance(options[name], dict):
            raise CommandError(
                14,
                f"BSON field '{ctx.name}.{name}' is the wrong type '{type_name(options[name])}', "
                "expected type 'object'",
            )
    level = options.get("validationLevel")
    if level is not None and level not in ("off", "strict", "moderate"):
        raise CommandError(
            2,
            f"Enumeration value '{level}' for field '{ctx.name}.validationLevel' is not a valid "
            "value.",
        )
    action = options.get("validationAction")
    if action is not None and action not in ("error", "warn", "errorAndLog"):
        raise CommandError(
            2,
            f"Enumeration value '{action}' for field '{ctx.name}.validationAction' is not a valid "
            "value.",
        )


@command("create", write=True)
def create(ctx: CommandContext) -> dict[str, Any]:
    name = collection_arg(ctx)
    _check_fields(ctx, _CREATE_FIELDS)
    options = {k: v for k, v in ctx.body.items() if k != ctx.name and k not in GENERIC_ARGS}
    _validate_create_options(ctx, options)
    if "pipeline" in options and "viewOn" not in options:
        raise CommandError(
            9, "'pipeline' requires 'viewOn' to also be specified", code_name="FailedToParse"
        )
    if "viewOn" in options:
        if not isinstance(options["viewOn"], str):
            raise CommandError(14, "'viewOn' option must be specified as a string")
        if not isinstance(options.setdefault("pipeline", []), list):
            raise CommandError(14, "'pipeline' option must be specified as an array")
        if name.startswith("system."):
            raise CommandError(
                73,
                "View name cannot start with 'system.', which is reserved for system namespaces",
            )
    unit = WriteUnit.open(ctx, ddl=True)
    existing = ctx.deployment.catalog.get(ctx.db, name)
    if existing is not None:
        ns = f"{ctx.db}.{name}"
        if ctx.deployment.profile.major_minor < (7, 0):
            raise CommandError(48, f"Collection {ns} already exists.")
        if canonical_options(existing.options) != canonical_options(options):
            shown = bson_repr({"uuid": existing.uuid, **canonical_options(existing.options)})
            raise CommandError(
                48, f"namespace {ns} already exists, but with different options: {shown}"
            )
        return {}
    create_collection(unit, ctx.db, name, options)
    return {}


# ======================================================================================
# drop / dropDatabase / renameCollection
# ======================================================================================


def drop_collection(unit: WriteUnit, state: CollectionState, *, log_view: bool = True) -> None:
    """Detach ``state`` and log its ``drop``; a view's drop is the removal of its
    ``system.views`` document (skipped when the whole database goes)."""
    catalog = unit.ctx.deployment.catalog
    catalog.detach(state.db, state.name)
    unit.on_undo(functools.partial(catalog.attach, state))
    if state.is_view:
        _sync_view_definition(unit if log_view else None, catalog, state, remove=True)
    else:
        unit.log("c", f"{state.db}.$cmd", {"drop": state.name}, ui=state.uuid)


@command("drop", write=True)
def drop(ctx: CommandContext) -> dict[str, Any]:
    name = collection_arg(ctx)
    unit = WriteUnit.open(ctx, ddl=True)
    state = ctx.deployment.catalog.get(ctx.db, name)
    if state is None:
        if ctx.deployment.profile.major_minor < (7, 0):
            raise CommandError(26, "ns not found")
        return {}
    n_indexes = len(state.indexes)
    drop_collection(unit, state)
    if state.is_view:
        return {"ns": state.ns}
    return {"nIndexesWas": n_indexes, "ns": state.ns}


@command("dropDatabase", write=True)
def drop_database(ctx: CommandContext) -> dict[str, Any]:
    check_db_name(ctx.db)
    if ctx.db == "local":
        raise CommandError(20, "Cannot drop 'local' database while replication is active")
    unit = WriteUnit.open(ctx, ddl=True)
    states = ctx.deployment.catalog.collections(ctx.db)
    if not states:
        return {}
    for state in states:
        drop_collection(unit, state, log_view=False)
    unit.log("c", f"{ctx.db}.$cmd", {"dropDatabase": 1})
    return {"dropped": ctx.db}


def _split_ns(value: Any, what: str) -> tuple[str, str]:
    if not isinstance(value, str) or "." not in value:
        raise CommandError(73, f"Invalid {what} namespace: {value}")
    db, coll = value.split(".", 1)
    check_collection_name(db, coll)
    return db, coll


@command("renameCollection", admin_only=True, write=True)
def rename_collection(ctx: CommandContext) -> dict[str, Any]:
    _check_fields(ctx, ("to", "dropTarget", "stayTemp", "collectionUUID"))
    src_db, src_name = _split_ns(ctx.target, "source")
    dst_db, dst_name = _split_ns(ctx.body.get("to"), "target")
    drop_target = bool(ctx.body.get("dropTarget", False))
    stay_temp = bool(ctx.body.get("stayTemp", False))
    unit = WriteUnit.open(ctx, ddl=True)
    catalog = ctx.deployment.catalog
    source = catalog.get(src_db, src_name)
    if source is None:
        raise CommandError(26, f"Source collection {src_db}.{src_name} does not exist")
    if source.is_view:
        raise CommandError(166, f"cannot rename view: {source.ns}")
    if (src_db, src_name) == (dst_db, dst_name):
        raise CommandError(20, "Can't rename a collection to itself")
    if src_db != dst_db:
        raise CommandError(
            20,
            "renameCollection across databases is not supported by the simulator",
            code_name="IllegalOperation",
        )
    target = catalog.get(dst_db, dst_name)
    if target is not None and not drop_target:
        raise CommandError(48, "target namespace exists")
    if target is not None and target.is_view:
        raise CommandError(166, f"cannot rename to a view: {target.ns}")
    o: dict[str, Any] = {
        "renameCollection": source.ns,
        "to": f"{dst_db}.{dst_name}",
        "stayTemp": stay_temp,
    }
    if target is not None:
        catalog.detach(target.db, target.name)
        unit.on_undo(lambda: catalog.attach(target))
        o["dropTarget"] = target.uuid
    old_db, old_name = source.db, source.name
    catalog.rename(source, dst_db, dst_name)
    unit.on_undo(lambda: catalog.rename(source, old_db, old_name))
    unit.log("c", f"{src_db}.$cmd", o, ui=source.uuid)
    return {}


# ======================================================================================
# Indexes
# ======================================================================================


def index_name(key: dict[str, Any]) -> str:
    """The default index name (``a_1_b_-1``)."""
    return "_".join(f"{field}_{value}" for field, value in key.items())


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
        if option not in ("v", "key", "name", "ns", "background"):
            spec[option] = copy_value(value)
    return spec


def _same_options(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def significant(spec: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in spec.items() if k not in ("v", "name", "ns", "background")}

    return values_equal(significant(a), significant(b))


def _spec_text(spec: dict[str, Any]) -> str:
    return bson_repr({k: v for k, v in spec.items() if k != "ns"})


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


def _find_index(state: CollectionState, selector: Any) -> dict[str, Any]:
    if isinstance(selector, dict):
        found = [spec for spec in state.indexes if values_equal(spec["key"], selector)]
        if not found:
            raise CommandError(27, f"can't find index with key: {bson_repr(selector)}")
        if len(found) > 1:
            raise CommandError(
                2,
                f"{len(found)} indexes found for key: {bson_repr(selector)}, identify by name "
                "instead. Conflicting indexes: " + ", ".join(_spec_text(spec) for spec in found),
                code_name="AmbiguousIndexKeyPattern",
            )
        return found[0]
    spec = state.index(selector)
    if spec is None:
        raise CommandError(27, f"index not found with name [{selector}]")
    return spec


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


# ======================================================================================
# collMod
# ======================================================================================

_COLLMOD_FIELDS = (
    "validator",
    "validationLevel",
    "validationAction",
    "changeStreamPreAndPostImages",
    "index",
    "viewOn",
    "pipeline",
    "expireAfterSeconds",
    "recordPreImages",
    "timeseries",
    "cappedSize",
    "cappedMax",
    "dryRun",
)


@dataclass(slots=True)
class _IndexMod:
    """What ``collMod.index`` changes: the index, its new spec and what to log and reply."""

    old_spec: dict[str, Any]
    new_spec: dict[str, Any]
    logged: dict[str, Any]
    """The ``index`` argument as logged (``keyPattern`` resolved to ``name``)."""
    old_options: dict[str, Any]
    """``indexOptions_old`` (only the options that change)."""
    reply: dict[str, Any]
    """``<option>_old`` / ``<option>_new`` reply fields."""


_INDEX_MOD_OPTIONS = ("expireAfterSeconds", "hidden", "prepareUnique", "unique")


def _collmod_index(state: CollectionState, spec: Any) -> _IndexMod:
    if not isinstance(spec, dict):
        raise CommandError(
            14,
            f"BSON field 'collMod.index' is the wrong type '{type_name(spec)}', expected type "
            "'object'",
        )
    if ("name" in spec) == ("keyPattern" in spec):
        raise CommandError(
            2,
            "Must specify either index name or key pattern for collMod.index"
            if "name" not in spec
            else "Both name and key pattern were specified for collMod.index",
        )
    target = _find_index(state, spec["keyPattern"] if "keyPattern" in spec else spec["name"])
    changes = {k: spec[k] for k in _INDEX_MOD_OPTIONS if k in spec}
    if not changes:
        raise CommandError(
            2, "no expireAfterSeconds, hidden, prepareUnique or unique field to modify"
        )
    if "hidden" in changes and target["name"] == "_id_":
        raise CommandError(72, "can't hide _id index", code_name="InvalidOptions")
    if "expireAfterSeconds" in changes and "expireAfterSeconds" not in target:
        raise CommandError(72, "no expireAfterSeconds field to update", code_name="InvalidOptions")
    mod = _IndexMod(target, dict(target), {"name": target["name"]}, {}, {})
    for option, after in changes.items():
        before = target.get(option, None if option == "expireAfterSeconds" else False)
        if option == "hidden" and not after:
            mod.new_spec.pop("hidden", None)
        else:
            mod.new_spec[option] = after
        mod.logged[option] = after
        if not values_equal(before, after):
            mod.old_options[option] = before
            mod.reply[f"{option}_old"] = before
            mod.reply[f"{option}_new"] = after
    return mod


@command("collMod", write=True)
def coll_mod(ctx: CommandContext) -> dict[str, Any]:
    name = collection_arg(ctx)
    _check_fields(ctx, _COLLMOD_FIELDS)
    args = {k: v for k, v in ctx.body.items() if k != ctx.name and k not in GENERIC_ARGS}
    _validate_create_options(ctx, args)
    unit = WriteUnit.open(ctx, ddl=True)
    state = ctx.deployment.catalog.get(ctx.db, name)
    if state is None:
        raise CommandError(26, "ns does not exist")
    for key in args:
        if state.is_view != (key in ("viewOn", "pipeline")):
            kind = "view" if state.is_view else "collection"
            raise CommandError(
                72, f"option not supported on a {kind}: {key}", code_name="InvalidOptions"
            )
    old_options = canonical_options(state.options)
    o: dict[str, Any] = {"collMod": name}
    o2: dict[str, Any] = {"collectionOptions_old": {"uuid": state.uuid, **old_options}}
    new_options = dict(state.options)
    index_mod: _IndexMod | None = None
    for key, value in args.items():
        if key == "index":
            index_mod = _collmod_index(state, value)
            o["index"] = index_mod.logged
            o2["indexOptions_old"] = index_mod.old_options
            continue
        o[key] = copy_value(value)
        if key in _CREATE_OPTION_ORDER:
            new_options[key] = copy_value(value)
    previous = state.options
    state.options = new_options
    unit.on_undo(functools.partial(setattr, state, "options", previous))
    if index_mod is not None:
        state.replace_index(index_mod.old_spec, index_mod.new_spec)
        unit.on_undo(functools.partial(state.replace_index, index_mod.new_spec, index_mod.old_spec))
    if state.is_view:
        _sync_view_definition(unit, ctx.deployment.catalog, state)
    else:
        unit.log("c", f"{ctx.db}.$cmd", o, ui=state.uuid, o2=o2)
    return index_mod.reply if index_mod is not None else {}


# ======================================================================================
# Listings
# ======================================================================================


def _collection_entry(state: CollectionState) -> dict[str, Any]:
    if state.is_view:
        return {
            "name": state.name,
            "type": "view",
            "options": {
                "viewOn": state.options["viewOn"],
                "pipeline": copy_value(state.options.get("pipeline", [])),
            },
            "info": {"readOnly": True},
        }
    return {
        "name": state.name,
        "type": "collection",
        "options": canonical_options(state.options),
        "info": {"readOnly": False, "uuid": state.uuid},
        "idIndex": copy_value(state.indexes[0]),
    }


@command("listCollections")
def list_collections(ctx: CommandContext) -> dict[str, Any]:
    check_db_name(ctx.db)
    query = ctx.body.get("filter") or {}
    if not isinstance(query, dict):
        raise CommandError(
            14,
            f"BSON field 'listCollections.filter' is the wrong type '{type_name(query)}', "
            "expected type 'object'",
        )
    batch_size = _cursor_options(ctx)
    name_only = bool(ctx.body.get("nameOnly", False))
    states = sorted(ctx.deployment.catalog.collections(ctx.db), key=lambda s: s.name)
    entries = []
    for state in states:
        entry = _collection_entry(state)
        if name_only:
            entry = {"name": entry["name"], "type": entry["type"]}
        if matches(query, entry):
            entries.append(entry)
    return open_cursor(ctx, f"{ctx.db}.$cmd.listCollections", entries, batch_size)


@command("listIndexes")
def list_indexes(ctx: CommandContext) -> dict[str, Any]:
    name = collection_arg(ctx)
    batch_size = _cursor_options(ctx)
    state = ctx.deployment.catalog.get(ctx.db, name)
    if state is None:
        raise CommandError(26, f"ns does not exist: {ctx.db}.{name}")
    if state.is_view:
        raise CommandError(166, f"Namespace {state.ns} is a view, not a collection")
    specs = [copy_value(spec) for spec in state.indexes]
    return open_cursor(ctx, f"{ctx.db}.$cmd.listIndexes.{name}", specs, batch_size)


_SYSTEM_DATABASES = ("admin", "config", "local")


def _database_size(catalog: Catalog, db: str) -> int:
    """A plausible ``sizeOnDisk``: 4 KiB per collection and index plus the document bytes."""
    size = 0
    for state in catalog.collections(db):
        size += 4096 * (1 + len(state.indexes))
        size += sum(len(bson.encode(doc, codec_options=_SIZE_OPTIONS)) for doc in state.stored())
    return size


@command("listDatabases", admin_only=True)
def list_databases(ctx: CommandContext) -> dict[str, Any]:
    query = ctx.body.get("filter") or {}
    name_only = bool(ctx.body.get("nameOnly", False))
    catalog = ctx.deployment.catalog
    names = set(catalog.database_names()) | set(_SYSTEM_DATABASES)
    databases = []
    total = 0
    for db in sorted(names):
        size = _database_size(catalog, db) or 8192 * 5
        entry: dict[str, Any] = (
            {"name": db} if name_only else {"name": db, "sizeOnDisk": size, "empty": False}
        )
        if matches(query, entry):
            databases.append(entry)
            total += size
    if name_only:
        return {"databases": databases}
    return {"databases": databases, "totalSize": total, "totalSizeMb": total // (1024 * 1024)}
