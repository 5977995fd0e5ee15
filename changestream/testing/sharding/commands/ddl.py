"""mongos's catalog commands and DDL: sent to the database's primary shard.

DDL on a sharded collection is logged by the primary shard only (the other
shards follow without an oplog entry, as a migration's ``fromMigrate`` entries
are invisible to change streams), so it gives one change event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bson.int64 import Int64

from ...core.context import CommandContext
from ...core.cursors import CursorBatch, cursor_reply
from ...core.errors import CommandError
from .forwarding import collection_name, forward, shard_body, unsharded_target
from .spec import router_command

if TYPE_CHECKING:
    from ..router import Router


@router_command("listCollections", locks=False)
@router_command("listIndexes", locks=False)
def list_catalog(router: Router, ctx: CommandContext) -> dict[str, Any]:
    shard = unsharded_target(router, ctx, create=False)
    if shard is None:
        if ctx.name == "listIndexes":
            raise CommandError(26, f"ns does not exist: {ctx.db}.{ctx.target}")
        return cursor_reply(0, f"{ctx.db}.$cmd.listCollections", CursorBatch([]), first=True)
    return forward(router, ctx, shard)


@router_command("listDatabases", admin_only=True, locks=False)
def list_databases(router: Router, ctx: CommandContext) -> dict[str, Any]:
    sizes: dict[str, int] = {}
    for shard in router.all_shards():
        reply = shard.command("admin", shard_body(ctx))
        for entry in reply.get("databases", ()):
            sizes[entry["name"]] = sizes.get(entry["name"], 0) + int(entry.get("sizeOnDisk", 0))
    names = ctx.body.get("nameOnly") is True
    dbs = [
        {"name": name} if names else {"name": name, "sizeOnDisk": Int64(size), "empty": False}
        for name, size in sorted(sizes.items())
    ]
    out: dict[str, Any] = {"databases": dbs}
    if not names:
        out["totalSize"] = Int64(sum(sizes.values()))
    return out


@router_command("create", locks=False)
@router_command("renameCollection", locks=False)
def create(router: Router, ctx: CommandContext) -> dict[str, Any]:
    db = ctx.db
    if ctx.name == "renameCollection":
        db = str(ctx.target).split(".", 1)[0]
        if router.table.sharded(str(ctx.target)) is not None:
            raise CommandError(20, "the simulator's mongos cannot rename a sharded collection")
    with router.cluster.ddl_lock:
        shard = router.primary_shard(db, create=True)
        assert shard is not None
        return forward(router, ctx, shard)


@router_command("createIndexes", locks=False)
@router_command("dropIndexes", "deleteIndexes", locks=False)
@router_command("collMod", locks=False)
def collection_ddl(router: Router, ctx: CommandContext) -> dict[str, Any]:
    with router.cluster.ddl_lock:
        shard = router.primary_shard(ctx.db, create=ctx.name == "createIndexes")
        if shard is None:
            raise CommandError(26, f"ns does not exist: {ctx.db}.{ctx.target}")
        out = forward(router, ctx, shard)
        sharded = router.table.sharded(f"{ctx.db}.{collection_name(ctx)}")
        if sharded is not None:
            router.cluster.mirror_collection(sharded.ns)
        return out


@router_command("drop", locks=False)
def drop(router: Router, ctx: CommandContext) -> dict[str, Any]:
    coll = collection_name(ctx)
    ns = f"{ctx.db}.{coll}"
    with router.cluster.ddl_lock:
        shard = router.primary_shard(ctx.db)
        if shard is None:
            return {}
        out = forward(router, ctx, shard)
        if router.table.sharded(ns) is not None:
            router.cluster.forget_collection(ns, keep=shard.name)
        return out


@router_command("dropDatabase", locks=False)
def drop_database(router: Router, ctx: CommandContext) -> dict[str, Any]:
    with router.cluster.ddl_lock:
        shard = router.primary_shard(ctx.db)
        if shard is None:
            return {}
        out = forward(router, ctx, shard)
        router.cluster.forget_database(ctx.db, keep=shard.name)
        return {k: v for k, v in out.items() if k != "dropped"} | {"dropped": ctx.db}
