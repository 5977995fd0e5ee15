"""mongos's writes: each statement goes to the shard owning its document's chunk.

``stmtIds`` keep retryable writes exact; an ordered batch is sent one run of
statements per shard at a time, so the writes (and their change events) keep
statement order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bson.objectid import ObjectId

from ...core.context import CommandContext
from ...core.errors import CommandError
from ..routing import ShardedCollection
from .forwarding import (
    collection_name,
    forward,
    raise_for,
    reject_transactions,
    run_on,
    shard_body,
    unsharded_target,
)
from .spec import router_command

if TYPE_CHECKING:
    from ..router import Router


@router_command("insert", locks=False)
def insert(router: Router, ctx: CommandContext) -> dict[str, Any]:
    reject_transactions(ctx)
    coll = collection_name(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}")
    if sharded is None:
        target = unsharded_target(router, ctx, create=True)
        assert target is not None
        return forward(router, ctx, target)
    docs = ctx.body.get("documents")
    if not isinstance(docs, list):
        raise CommandError(40414, "BSON field 'insert.documents' is missing but a required field")
    owners: list[tuple[int, str]] = []
    prepared = []
    for i, raw in enumerate(docs):
        doc = raw
        if isinstance(raw, dict) and "_id" not in raw:
            doc = {"_id": ObjectId(), **raw}
        prepared.append(doc)
        key = sharded.key_of(doc) if isinstance(doc, dict) else ()
        owners.append((i, sharded.chunk_for(key).shard if key else sharded.chunks[0].shard))
    return _write_groups(router, ctx, "documents", prepared, _batches(ctx, owners))


def _batches(ctx: CommandContext, owners: list[tuple[int, str]]) -> list[tuple[str, list[int]]]:
    """The child batches mongos sends for statements ``(index, shard)``, in sending order.

    Unordered: one batch per shard. Ordered: mongos targets one shard at a
    time, so each run of consecutive statements for one shard is its own
    batch, sent after the previous one succeeded: the writes are applied (and
    their change events ordered) in statement order, and an error stops them
    all from there.
    """
    batches: list[tuple[str, list[int]]] = []
    if ctx.body.get("ordered", True) is not False:
        for i, shard in owners:
            if batches and batches[-1][0] == shard:
                batches[-1][1].append(i)
            else:
                batches.append((shard, [i]))
        return batches
    groups: dict[str, list[int]] = {}
    for i, shard in owners:
        groups.setdefault(shard, []).append(i)
    return list(groups.items())


def _write_groups(
    router: Router,
    ctx: CommandContext,
    field: str,
    statements: list[Any],
    groups: list[tuple[str, list[int]]],
) -> dict[str, Any]:
    """Send each shard its statements (original ``stmtIds``) and merge the write replies."""
    ordered = ctx.body.get("ordered", True) is not False
    n = 0
    modified = 0
    errors: list[dict[str, Any]] = []
    upserted: list[dict[str, Any]] = []
    wce: Any = None
    for shard_name, indexes in groups:
        shard = router.shard(shard_name)
        body = shard_body(ctx, **{field: [statements[i] for i in indexes]})
        if ctx.txn_number is not None:
            body["stmtIds"] = list(indexes)
        body.pop("stmtId", None)
        reply = run_on(shard, ctx, body)
        raise_for(reply)
        n += int(reply.get("n", 0))
        modified += int(reply.get("nModified", 0))
        for err in reply.get("writeErrors", ()):
            errors.append({**err, "index": indexes[int(err["index"])]})
        for up in reply.get("upserted", ()):
            upserted.append({**up, "index": indexes[int(up["index"])]})
        wce = wce or reply.get("writeConcernError")
        if errors and ordered:
            break
    out: dict[str, Any] = {"n": n}
    if field == "updates":
        out["nModified"] = modified
        if upserted:
            out["upserted"] = sorted(upserted, key=lambda u: u["index"])
    if errors:
        out["writeErrors"] = sorted(errors, key=lambda e: e["index"])
    if wce is not None:
        out["writeConcernError"] = wce
    return out


def _owner(
    router: Router, ctx: CommandContext, sharded: ShardedCollection, query: dict[str, Any]
) -> str | None:
    """The shard holding the first document ``query`` matches (a targeted single write)."""
    key = sharded.exact_key(query)
    if key is not None:
        return sharded.chunk_for(key).shard
    for shard in router.targets(sharded, query):
        body: dict[str, Any] = {
            "find": sharded.ns.split(".", 1)[1], "filter": query, "limit": 1,
            "projection": {"_id": 1}, "singleBatch": True,
        }  # fmt: skip
        if "collation" in ctx.body:
            body["collation"] = ctx.body["collation"]
        reply = shard.run(ctx.db, body)
        raise_for(reply)
        if reply["cursor"]["firstBatch"]:
            return shard.name
    return None


def _upsert_shard(sharded: ShardedCollection, query: dict[str, Any]) -> str:
    values = {name: query.get(name) for name in sharded.fields}
    return sharded.chunk_for(sharded.key_of(values)).shard


@router_command("update", locks=False)
@router_command("delete", locks=False)
def update_or_delete(router: Router, ctx: CommandContext) -> dict[str, Any]:
    reject_transactions(ctx)
    coll = collection_name(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}")
    if sharded is None:
        target = unsharded_target(router, ctx, create=ctx.name == "update")
        if target is None:
            return {"n": 0} if ctx.name == "delete" else {"n": 0, "nModified": 0}
        return forward(router, ctx, target)
    field = "updates" if ctx.name == "update" else "deletes"
    statements = ctx.body.get(field)
    if not isinstance(statements, list):
        raise CommandError(
            40414, f"BSON field '{ctx.name}.{field}' is missing but a required field"
        )
    owners: list[tuple[int, str]] = []
    broadcast: list[int] = []
    for i, stmt in enumerate(statements):
        query = stmt.get("q") if isinstance(stmt, dict) else None
        query = query if isinstance(query, dict) else {}
        multi = stmt.get("multi") if field == "updates" else stmt.get("limit") == 0
        if multi and sharded.exact_key(query) is None:
            broadcast.append(i)
            continue
        owner = _owner(router, ctx, sharded, query)
        if owner is None:
            owner = (
                _upsert_shard(sharded, query)
                if field == "updates" and stmt.get("upsert")
                else sharded.chunks[0].shard
            )
        owners.append((i, owner))
    out = _write_groups(router, ctx, field, statements, _batches(ctx, owners))
    for i in broadcast:
        for shard in router.targets(sharded, statements[i].get("q")):
            part = _write_groups(router, ctx, field, statements, [(shard.name, [i])])
            out["n"] += part["n"]
            if "nModified" in out:
                out["nModified"] += part.get("nModified", 0)
            if "writeErrors" in part:
                out.setdefault("writeErrors", []).extend(part["writeErrors"])
    return out


@router_command("findAndModify", "findandmodify", locks=False)
def find_and_modify(router: Router, ctx: CommandContext) -> dict[str, Any]:
    reject_transactions(ctx)
    coll = collection_name(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}")
    if sharded is None:
        target = unsharded_target(router, ctx, create=True)
        assert target is not None
        return forward(router, ctx, target)
    query = ctx.body.get("query")
    query = query if isinstance(query, dict) else {}
    owner = _owner(router, ctx, sharded, query)
    if owner is None:
        owner = _upsert_shard(sharded, query) if ctx.body.get("upsert") else sharded.chunks[0].shard
    return forward(router, ctx, router.shard(owner))
