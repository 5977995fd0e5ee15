"""Collection, view and database DDL commands: create, drop, dropDatabase,
renameCollection, collMod.

Every DDL write logs the command entry mongod logs (``ns = "db.$cmd"``, the
collection UUID in ``ui``), in mongod's order: a collection created
implicitly by a write is logged before the write; ``dropDatabase`` logs one
``drop`` per collection, then ``dropDatabase``; a rename that replaces its
target records the dropped target's UUID in ``dropTarget`` instead of logging
a separate drop. Views have no UUID and no ``create`` entry: as in mongod,
creating, modifying and dropping a view is logged only as an insert,
replacement or delete of its document in ``db.system.views`` (whose own
creation is logged once). Index DDL is in :mod:`.indexes`, the listings in
:mod:`.listing`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ..core.context import CommandContext
from ..core.errors import CommandError
from ..storage import (
    Catalog,
    CollectionState,
    bson_repr,
    check_collection_name,
    check_db_name,
    copy_value,
    id_key,
    type_name,
    values_equal,
)
from ..storage.sessions import WriteUnit
from .common import GENERIC_ARGS, _check_fields, _find_index, collection_arg
from .spec import command

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




