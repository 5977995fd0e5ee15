"""The listing commands: ``listCollections``, ``listIndexes`` and ``listDatabases``.
"""

from __future__ import annotations

from typing import Any

import bson

from ..core.context import CommandContext
from ..core.errors import CommandError
from ..storage import (
    Catalog,
    CollectionState,
    check_db_name,
    copy_value,
    matches,
    type_name,
)
from .common import _SIZE_OPTIONS, _cursor_options, collection_arg, open_cursor
from .ddl import canonical_options
from .spec import command

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


