"""mongos's reads: ``find``, ``count``, ``distinct``, ``aggregate`` and change streams.

Reads of an unsharded collection go whole to its shard; reads of a sharded one
go to the shards the filter's shard key pins (or all) and are merged here. A
change stream opens one cursor per shard, merged by :mod:`..merge`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...changestreams.stage import CHANGE_STREAM, lite_parse, parse_change_stream
from ...commands.aggregate import run_stage
from ...core.context import CommandContext
from ...core.cursors import CursorBatch, cursor_reply
from ...core.errors import CommandError
from ...storage.order import compare_values, values_equal
from ...storage.query import path_values
from ..merge import MergedChangeStream
from ..routing import ShardedCollection
from ..shards import Shard
from .forwarding import (
    DROP,
    FIND_BATCH,
    SnapshotTarget,
    buffered_reply,
    collection_name,
    drain,
    forward,
    raise_for,
    reject_transactions,
    run_on,
    session_id,
    shard_body,
    snapshot_target,
    unsharded_target,
)
from .spec import router_command

if TYPE_CHECKING:
    from ..router import Router

_PASSTHROUGH = ("collation", "comment", "$_generateV2ResumeTokens", "readConcern")
"""The aggregate's options every shard's change-stream cursor is opened with."""


def _sort_key(sort: dict[str, Any]) -> Callable[[Any], Any]:
    def compare(a: Any, b: Any) -> int:
        for name, direction in sort.items():
            x = path_values(a, name)
            y = path_values(b, name)
            order = compare_values(x[0] if x else None, y[0] if y else None)
            if order:
                return order if direction != -1 else -order
        return 0

    return functools.cmp_to_key(compare)


@router_command("find", locks=False)
def find(router: Router, ctx: CommandContext) -> dict[str, Any]:
    coll = collection_name(ctx)
    ns = f"{ctx.db}.{coll}"
    sharded = router.table.sharded(ns)
    if sharded is None:
        target = unsharded_target(router, ctx, create=False)
        if target is None:
            return _empty_snapshot_reply(router, ctx, ns)
        return _forward_read(router, ctx, target)
    reject_transactions(ctx)
    body = ctx.body
    targets, snapshot = _read_targets(router, ctx, sharded, body.get("filter"))
    skip = int(body.get("skip") or 0)
    limit = int(body.get("limit") or 0)
    single = body.get("singleBatch") is True
    changes: dict[str, Any] = {"skip": DROP, "batchSize": FIND_BATCH, "singleBatch": DROP}
    changes["limit"] = skip + limit if limit else DROP
    if snapshot is not None:
        changes["readConcern"] = snapshot.concern(ctx)
    docs: list[Any] = []
    for shard in targets:
        docs.extend(drain(shard, ctx, shard_body(ctx, **changes)))
    sort = body.get("sort")
    if isinstance(sort, dict) and sort:
        docs.sort(key=_sort_key(sort))
    docs = docs[skip:]
    if limit:
        docs = docs[:limit]
    batch_size = body.get("batchSize")
    at = snapshot.at if snapshot is not None else None
    if single:
        batch = CursorBatch(docs[: batch_size or None], at_cluster_time=at)
        return cursor_reply(0, ns, batch, first=True)
    size = int(batch_size) if batch_size is not None else 101
    return buffered_reply(ctx, ns, docs, size, snapshot)


def _read_targets(
    router: Router, ctx: CommandContext, sharded: ShardedCollection, query: Any
) -> tuple[list[Shard], SnapshotTarget | None]:
    """The shards a read of a sharded collection visits, and its snapshot (if it is one).

    mongos routes a snapshot read by the chunks as they were at its cluster time, so a
    chunk moved since is still read where it was. The simulator keeps no routing history,
    but its migrations move documents at one cluster time (no orphans), so every shard
    read at that time holds each document of that time exactly once: a snapshot read
    visits them all (the current owners could miss a chunk that left a shard since).
    """
    snapshot = snapshot_target(router, ctx, router.all_shards())
    if snapshot is not None:
        return list(snapshot.shards), snapshot
    return router.targets(sharded, query), None


def _forward_read(router: Router, ctx: CommandContext, shard: Shard) -> dict[str, Any]:
    """A read of an unsharded collection, sent whole to its shard (at mongos's time when it
    is a snapshot read)."""
    snapshot = snapshot_target(router, ctx, [shard])
    if snapshot is None:
        return forward(router, ctx, shard)
    return forward(router, ctx, shard, readConcern=snapshot.concern(ctx))


def _empty_snapshot_reply(router: Router, ctx: CommandContext, ns: str) -> dict[str, Any]:
    """No database: no documents (at mongos's time when it is a snapshot read)."""
    snapshot = snapshot_target(router, ctx, [])
    at = snapshot.at if snapshot is not None else None
    return cursor_reply(0, ns, CursorBatch([], exhausted=True, at_cluster_time=at), first=True)


@router_command("count", locks=False)
def count(router: Router, ctx: CommandContext) -> dict[str, Any]:
    coll = collection_name(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}")
    if sharded is None:
        target = unsharded_target(router, ctx, create=False)
        return {"n": 0} if target is None else forward(router, ctx, target)
    total = 0
    for shard in router.targets(sharded, ctx.body.get("query")):
        reply = run_on(shard, ctx, shard_body(ctx, skip=DROP, limit=DROP))
        raise_for(reply)
        total += int(reply.get("n", 0))
    total = max(0, total - int(ctx.body.get("skip") or 0))
    limit = int(ctx.body.get("limit") or 0)
    return {"n": min(total, abs(limit)) if limit else total}


@router_command("distinct", locks=False)
def distinct(router: Router, ctx: CommandContext) -> dict[str, Any]:
    coll = collection_name(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}")
    if sharded is None:
        target = unsharded_target(router, ctx, create=False)
        return {"values": []} if target is None else forward(router, ctx, target)
    values: list[Any] = []
    for shard in router.targets(sharded, ctx.body.get("query")):
        reply = run_on(shard, ctx, shard_body(ctx))
        raise_for(reply)
        for value in reply.get("values", ()):
            if not any(values_equal(value, seen) for seen in values):
                values.append(value)
    return {"values": values}


@router_command("aggregate", locks=False)
def aggregate(router: Router, ctx: CommandContext) -> dict[str, Any]:
    body = ctx.body
    pipeline = body.get("pipeline")
    if not isinstance(pipeline, list):
        raise CommandError(40414, "BSON field 'aggregate.pipeline' is missing but a required field")
    target = ctx.target
    coll = target if isinstance(target, str) and target else None
    if any(isinstance(stage, dict) and CHANGE_STREAM in stage for stage in pipeline):
        return _change_stream(router, ctx, coll, pipeline)
    reject_transactions(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}") if coll else None
    if sharded is None:
        shard = unsharded_target(router, ctx, create=False)
        if shard is None:
            shard = router.all_shards()[0]
        return _forward_read(router, ctx, shard)
    targets, snapshot = _read_targets(router, ctx, sharded, None)
    # the leading $match stages run on the shards (as mongos splits a pipeline), the rest here
    pushed = 0
    while pushed < len(pipeline) and _is_match(pipeline[pushed]):
        pushed += 1
    source: dict[str, Any] = {
        "aggregate": coll, "pipeline": pipeline[:pushed], "cursor": {"batchSize": FIND_BATCH},
    }  # fmt: skip
    if snapshot is not None:
        source["readConcern"] = snapshot.concern(ctx)
    docs: list[Any] = []
    for shard in targets:
        docs.extend(drain(shard, ctx, source))
    for name, spec in lite_parse(router.profile, pipeline[pushed:]):
        docs = run_stage(docs, name, spec)
    cursor = body.get("cursor")
    size = cursor.get("batchSize") if isinstance(cursor, dict) else None
    ns = f"{ctx.db}.{coll}"
    return buffered_reply(ctx, ns, docs, int(size) if size is not None else 101, snapshot)


def _is_match(stage: Any) -> bool:
    return isinstance(stage, dict) and list(stage) == ["$match"]


def _change_stream(
    router: Router, ctx: CommandContext, coll: str | None, pipeline: list[Any]
) -> dict[str, Any]:
    ctx.is_change_stream = True
    profile = router.profile
    stages = lite_parse(profile, pipeline)
    spec_stage = next(spec for name, spec in stages if name == CHANGE_STREAM)
    if isinstance(spec_stage, dict) and "showMigrationEvents" in spec_stage:
        raise CommandError(
            31123, "Change stream on mongos doesn't support showing migration events"
        )
    generate_v2 = ctx.body.get("$_generateV2ResumeTokens")
    spec = parse_change_stream(
        profile, stages, db=ctx.db, coll=coll, standalone=False,
        generate_v2_tokens=generate_v2 if isinstance(generate_v2, bool) else None,
    )  # fmt: skip
    if ctx.body.get("explain"):
        return {"stages": [{name: value} for name, value in stages]}
    passthrough = {k: ctx.body[k] for k in _PASSTHROUGH if k in ctx.body}
    if isinstance(spec_stage, dict):
        ctx.deployment.cs_metrics.router_stream_opened(spec_stage)
    options = ctx.body.get("cursor")
    size = options.get("batchSize") if isinstance(options, dict) else None
    cursor = MergedChangeStream(
        router, ctx.db, coll, pipeline, spec, passthrough, session_id(ctx),
        first_batch_size=size if isinstance(size, int) else None,
    )  # fmt: skip
    batch = cursor.open()
    cid = ctx.deployment.cursors.register(cursor, ctx.member.name)
    return cursor_reply(cid, cursor.ns, batch, first=True)
