"""mongos's commands: route each one to the shards, merge their replies.

Unsharded collections live on their database's primary shard and their
commands are forwarded there whole. A sharded collection's writes go to the
shard owning each document's chunk (``stmtIds`` keep retryable writes exact);
its reads go to the shards the filter's shard key pins, or to all of them, and
are merged here. DDL on a sharded collection is logged by the primary shard
only (the other shards apply it without an oplog entry, as a migration's
``fromMigrate`` entries are invisible to change streams), so it gives one event.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from ..changestreams.stage import CHANGE_STREAM, lite_parse, parse_change_stream
from ..commands.admin import (
    LOGICAL_SESSION_TIMEOUT_MINUTES,
    MAX_BSON_OBJECT_SIZE,
    MAX_WRITE_BATCH_SIZE,
    _await_topology_change,
    _compression_offer,
    _take_client_metadata,
)
from ..commands.aggregate import _run_stage
from ..commands.registry import REGISTRY as MONGOD_COMMANDS
from ..commands.spec import CommandSpec
from ..core.codec import MAX_MESSAGE_SIZE
from ..core.context import CommandContext
from ..core.cursors import CursorBatch, cursor_reply
from ..core.errors import CommandError
from ..core.topology import topology_version
from ..storage.order import compare_values, values_equal
from ..storage.query import path_values
from .merge import MergedChangeStream
from .routing import (
    Chunk,
    ShardedCollection,
    compare_keys,
    key_document,
    parse_key_document,
)
from .shards import Shard

if TYPE_CHECKING:
    from .cluster import ClusterState

RouterHandler = Callable[["Router", CommandContext], dict[str, Any]]
_MARK = "__router_commands__"

_SHARED = (
    "buildInfo", "buildinfo", "ping", "getParameter", "serverStatus", "hostInfo",
    "connectionStatus", "whatsmyuri", "getCmdLineOpts", "endSessions", "refreshSessions",
    "killSessions", "killAllSessions", "getMore", "killCursors", "configureFailPoint",
    "waitForFailPoint",
)  # fmt: skip
"""mongod commands that behave the same on mongos (they act on the mongos itself)."""
_NOT_FORWARDED = frozenset({"$db", "$clusterTime", "$readPreference", "lsid", "txnNumber"})
_PASSTHROUGH = ("collation", "comment", "$_generateV2ResumeTokens", "readConcern")
_FIND_BATCH = 1_000_000


def router_command(*names: str, **flags: Any) -> Callable[[RouterHandler], RouterHandler]:
    """Mark ``handler`` as mongos's command ``names[0]`` (collected by :func:`registry_for`)."""

    def mark(handler: RouterHandler) -> RouterHandler:
        marks = getattr(handler, _MARK, ())
        setattr(handler, _MARK, (*marks, *((name, {"name": names[0], **flags}) for name in names)))
        return handler

    return mark


def registry_for(router: Router) -> dict[str, CommandSpec]:
    """The mongos command table: the shared mongod commands plus the routed ones."""
    registry = {name: MONGOD_COMMANDS[name] for name in _SHARED if name in MONGOD_COMMANDS}
    for value in list(globals().values()):
        for name, flags in getattr(value, _MARK, ()):
            registry[name] = CommandSpec(handler=functools.partial(value, router), **flags)
    return registry


# ======================================================================================
# The router (one per mongos)
# ======================================================================================


class Router:
    """One mongos: its connections to the shards and what it routes by."""

    def __init__(self, cluster: ClusterState, service_id: ObjectId) -> None:
        self.cluster = cluster
        self.table = cluster.table
        self.clock = cluster.clock
        self.profile = cluster.profile
        self.service_id = service_id
        self._shards: dict[str, Shard] = {}
        self.config = Shard("config", cluster.config)

    def shard(self, name: str) -> Shard:
        shard = self._shards.get(name)
        if shard is None:
            shard = self._shards[name] = Shard(name, self.cluster.replica_set(name))
        return shard

    def all_shards(self) -> list[Shard]:
        return [self.shard(name) for name in self.table.shard_names()]

    def primary_shard(self, db: str, *, create: bool = False) -> Shard | None:
        name = self.table.primary_of(db, create=create)
        if name is None:
            return None
        if create:
            self.cluster.record_database(db, name)
        return self.shard(name)

    def targets(self, coll: ShardedCollection, query: dict[str, Any] | None) -> list[Shard]:
        """The shards a query on ``coll`` must visit (one when it pins the shard key)."""
        key = coll.exact_key(query or {})
        if key is not None:
            return [self.shard(coll.chunk_for(key).shard)]
        return [self.shard(name) for name in coll.shards()]


# ======================================================================================
# Forwarding
# ======================================================================================


def _strip(reply: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in reply.items() if k not in ("ok", "$clusterTime", "operationTime")}


def _raise_for(reply: dict[str, Any]) -> None:
    if reply.get("ok") == 1.0:
        return
    code = reply.get("code")
    extra = {
        k: v
        for k, v in reply.items()
        if k not in ("ok", "errmsg", "code", "codeName", "errorLabels", "$clusterTime",
                     "operationTime", "topologyVersion")
    }  # fmt: skip
    raise CommandError(
        code if isinstance(code, int) else 1,
        str(reply.get("errmsg", "")),
        code_name=reply.get("codeName") if isinstance(reply.get("codeName"), str) else None,
        extra=extra,
    )


def _body(ctx: CommandContext, **changes: Any) -> dict[str, Any]:
    body = {k: v for k, v in ctx.body.items() if k not in ("$db", "$clusterTime")}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP: Any = object()


def _run(shard: Shard, ctx: CommandContext, body: dict[str, Any]) -> dict[str, Any]:
    reply = shard.run(ctx.db, body)
    if isinstance(reply.get("operationTime"), Timestamp):
        ctx.operation_time = max(
            ctx.operation_time or reply["operationTime"], reply["operationTime"],
            key=lambda ts: (ts.time, ts.inc),
        )  # fmt: skip
    return reply


def forward(router: Router, ctx: CommandContext, shard: Shard, **changes: Any) -> dict[str, Any]:
    """Send the command to one shard; its reply (a cursor wrapped in a mongos cursor)."""
    reply = _run(shard, ctx, _body(ctx, **changes))
    _raise_for(reply)
    out = _strip(reply)
    cursor = out.get("cursor")
    if isinstance(cursor, dict) and cursor.get("id"):
        remote = RemoteCursor(shard, ctx.db, str(cursor["ns"]), int(cursor["id"]), _lsid(ctx))
        remote.session = ctx.lsid
        cid = ctx.deployment.cursors.register(remote, ctx.member.name)
        out["cursor"] = {**cursor, "id": Int64(cid)}
    return out


def _lsid(ctx: CommandContext) -> bytes | None:
    sid = (ctx.lsid or {}).get("id")
    raw = getattr(sid, "bytes", sid)
    return bytes(raw) if isinstance(raw, (bytes, bytearray)) else None


class RemoteCursor:
    """A mongos cursor over one shard cursor (unsharded reads): getMore is forwarded."""

    tailable_await = False

    def __init__(self, shard: Shard, db: str, ns: str, cid: int, lsid_id: bytes | None) -> None:
        self.shard, self.db, self.ns, self.cid, self.lsid_id = shard, db, ns, cid, lsid_id
        self._collection = ns.split(".", 1)[1]
        self._done = False
        self.session: dict[str, Any] | None = None
        """The ``lsid`` the shard cursor was opened in (its getMores must carry it)."""

    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch:
        body: dict[str, Any] = {"getMore": Int64(self.cid), "collection": self._collection}
        if batch_size:
            body["batchSize"] = batch_size
        if self.session is not None:
            body["lsid"] = self.session
        reply = self.shard.run(self.db, body)
        _raise_for(reply)
        cursor = reply["cursor"]
        self._done = not cursor.get("id")
        at = cursor.get("atClusterTime")
        return CursorBatch(
            list(cursor.get("nextBatch", ())),
            exhausted=self._done,
            at_cluster_time=at if isinstance(at, Timestamp) else None,
        )

    def close(self) -> None:
        if not self._done:
            self._done = True
            with contextlib.suppress(CommandError):
                self.shard.run(
                    self.db, {"killCursors": self._collection, "cursors": [Int64(self.cid)]}
                )


class BufferedCursor:
    """A mongos cursor over results merged here (reads of a sharded collection).

    A snapshot read's cursor reports its time in every batch and, as the shard
    cursors behind a real mongos would, fails with SnapshotTooOld (239) once
    the time has left a shard's history window.
    """

    tailable_await = False

    def __init__(
        self,
        ns: str,
        remaining: list[Any],
        lsid_id: bytes | None,
        snapshot: SnapshotTarget | None = None,
    ) -> None:
        self.ns, self.remaining, self.lsid_id = ns, remaining, lsid_id
        self.snapshot = snapshot

    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch:
        snapshot = self.snapshot
        if snapshot is not None:
            for shard in snapshot.shards:
                shard.deployment.history.check(snapshot.at)
        count = len(self.remaining) if batch_size is None else batch_size
        docs, self.remaining = self.remaining[:count], self.remaining[count:]
        return CursorBatch(
            docs,
            exhausted=not self.remaining,
            at_cluster_time=snapshot.at if snapshot is not None else None,
        )

    def close(self) -> None:
        self.remaining = []


def _buffered_reply(
    ctx: CommandContext,
    ns: str,
    docs: list[Any],
    batch_size: int | None,
    snapshot: SnapshotTarget | None = None,
) -> dict[str, Any]:
    size = len(docs) if batch_size is None else batch_size
    cursor = BufferedCursor(ns, docs[size:], _lsid(ctx), snapshot)
    batch = CursorBatch(
        docs[:size],
        exhausted=not cursor.remaining,
        at_cluster_time=snapshot.at if snapshot is not None else None,
    )
    cid = 0 if batch.exhausted else ctx.deployment.cursors.register(cursor, ctx.member.name)
    return cursor_reply(cid, ns, batch, first=True)


def _drain(shard: Shard, ctx: CommandContext, body: dict[str, Any]) -> list[Any]:
    """Every document of a cursor command on one shard."""
    reply = _run(shard, ctx, body)
    _raise_for(reply)
    cursor = reply["cursor"]
    docs = list(cursor.get("firstBatch", ()))
    collection = str(cursor["ns"]).split(".", 1)[1]
    cid = cursor.get("id")
    while cid:
        reply = shard.run(ctx.db, {"getMore": Int64(cid), "collection": collection})
        _raise_for(reply)
        cursor = reply["cursor"]
        docs.extend(cursor.get("nextBatch", ()))
        cid = cursor.get("id")
    return docs


@dataclass(frozen=True, slots=True)
class SnapshotTarget:
    """A point-in-time read through mongos: its cluster time and the shards it reads."""

    at: Timestamp
    shards: tuple[Shard, ...]

    def concern(self, ctx: CommandContext) -> dict[str, Any]:
        """The ``readConcern`` sent to every shard: the client's, at this one time."""
        return {**ctx.body["readConcern"], "atClusterTime": self.at}


def _snapshot(router: Router, ctx: CommandContext, shards: list[Shard]) -> SnapshotTarget | None:
    """The read's cluster time when it is a snapshot read outside a transaction (5.0+).

    Without ``atClusterTime`` mongos picks the latest cluster time (every
    shard applies its writes under its lock before a read there runs, so a
    write with an earlier time is already visible) and reports it. A bad
    ``atClusterTime`` and servers before 5.0 are left to the shards to refuse.
    """
    concern = ctx.body.get("readConcern")
    if not isinstance(concern, dict) or concern.get("level") != "snapshot":
        return None
    if ctx.autocommit is not None or router.profile.major_minor < (5, 0):
        return None
    at = concern.get("atClusterTime", router.clock.current())
    if not isinstance(at, Timestamp):
        return None
    return SnapshotTarget(at, tuple(shards))


def _collection(ctx: CommandContext) -> str:
    target = ctx.target
    if not isinstance(target, str) or not target:
        raise CommandError(73, f"Invalid namespace specified '{ctx.db}.{target}'")
    return target


def _reject_transactions(ctx: CommandContext) -> None:
    if ctx.autocommit is not None or ctx.start_transaction:
        raise CommandError(
            263, "the simulator's mongos does not run transactions; use a replica set"
        )


def _unsharded_target(router: Router, ctx: CommandContext, *, create: bool) -> Shard | None:
    if ctx.db == "config":
        return router.config
    return router.primary_shard(ctx.db, create=create)


# ======================================================================================
# hello
# ======================================================================================


@router_command("hello", locks=False, any_member=True, handshake=True)
@router_command("isMaster", "ismaster", locks=False, any_member=True, handshake=True)
def hello(router: Router, ctx: CommandContext) -> dict[str, Any]:
    """mongos's handshake: ``msg: "isdbgrid"``, no set name; ``serviceId`` behind a load balancer."""
    body, conn, member = ctx.body, ctx.connection, ctx.member
    profile = router.profile
    _take_client_metadata(body, conn)
    offered = _compression_offer(ctx)
    if ("topologyVersion" in body) != ("maxAwaitTimeMS" in body):
        raise CommandError(
            31368, "A request with a 'topologyVersion' must include 'maxAwaitTimeMS'"
        )
    if "topologyVersion" in body and profile.topology_version:
        _await_topology_change(member, body["topologyVersion"], body["maxAwaitTimeMS"], conn)
    reply: dict[str, Any] = {}
    if body.get("helloOk") is not None:
        reply["helloOk"] = True
    reply["ismaster" if ctx.name in ("isMaster", "ismaster") else "isWritablePrimary"] = True
    reply["msg"] = "isdbgrid"
    if profile.topology_version:
        reply["topologyVersion"] = topology_version(member)
    reply["maxBsonObjectSize"] = MAX_BSON_OBJECT_SIZE
    reply["maxMessageSizeBytes"] = MAX_MESSAGE_SIZE
    reply["maxWriteBatchSize"] = MAX_WRITE_BATCH_SIZE
    reply["localTime"] = router.clock.wall()
    reply["logicalSessionTimeoutMinutes"] = LOGICAL_SESSION_TIMEOUT_MINUTES
    reply["connectionId"] = conn.id
    reply["minWireVersion"] = 0
    reply["maxWireVersion"] = profile.max_wire_version
    reply["readOnly"] = False
    if router.cluster.is_load_balanced(member.name, conn.id):  # the LB port serves LB clients only
        reply["serviceId"] = router.service_id
    if offered is not None:
        conn.compressors = member.compressors.negotiate(offered)
    if conn.compressors:
        reply["compression"] = list(conn.compressors)
    return reply


# ======================================================================================
# Writes
# ======================================================================================


@router_command("insert", locks=False)
def insert(router: Router, ctx: CommandContext) -> dict[str, Any]:
    _reject_transactions(ctx)
    coll = _collection(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}")
    if sharded is None:
        target = _unsharded_target(router, ctx, create=True)
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
        body = _body(ctx, **{field: [statements[i] for i in indexes]})
        if ctx.txn_number is not None:
            body["stmtIds"] = list(indexes)
        body.pop("stmtId", None)
        reply = _run(shard, ctx, body)
        _raise_for(reply)
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
        _raise_for(reply)
        if reply["cursor"]["firstBatch"]:
            return shard.name
    return None


def _upsert_shard(sharded: ShardedCollection, query: dict[str, Any]) -> str:
    values = {name: query.get(name) for name in sharded.fields}
    return sharded.chunk_for(sharded.key_of(values)).shard


@router_command("update", locks=False)
@router_command("delete", locks=False)
def update_or_delete(router: Router, ctx: CommandContext) -> dict[str, Any]:
    _reject_transactions(ctx)
    coll = _collection(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}")
    if sharded is None:
        target = _unsharded_target(router, ctx, create=ctx.name == "update")
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
    _reject_transactions(ctx)
    coll = _collection(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}")
    if sharded is None:
        target = _unsharded_target(router, ctx, create=True)
        assert target is not None
        return forward(router, ctx, target)
    query = ctx.body.get("query")
    query = query if isinstance(query, dict) else {}
    owner = _owner(router, ctx, sharded, query)
    if owner is None:
        owner = _upsert_shard(sharded, query) if ctx.body.get("upsert") else sharded.chunks[0].shard
    return forward(router, ctx, router.shard(owner))


# ======================================================================================
# Reads
# ======================================================================================


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
    coll = _collection(ctx)
    ns = f"{ctx.db}.{coll}"
    sharded = router.table.sharded(ns)
    if sharded is None:
        target = _unsharded_target(router, ctx, create=False)
        if target is None:
            return _empty_snapshot_reply(router, ctx, ns)
        return _forward_read(router, ctx, target)
    _reject_transactions(ctx)
    body = ctx.body
    targets = router.targets(sharded, body.get("filter"))
    snapshot = _snapshot(router, ctx, targets)
    skip = int(body.get("skip") or 0)
    limit = int(body.get("limit") or 0)
    single = body.get("singleBatch") is True
    changes: dict[str, Any] = {"skip": _DROP, "batchSize": _FIND_BATCH, "singleBatch": _DROP}
    changes["limit"] = skip + limit if limit else _DROP
    if snapshot is not None:
        changes["readConcern"] = snapshot.concern(ctx)
    docs: list[Any] = []
    for shard in targets:
        docs.extend(_drain(shard, ctx, _body(ctx, **changes)))
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
    return _buffered_reply(ctx, ns, docs, size, snapshot)


def _forward_read(router: Router, ctx: CommandContext, shard: Shard) -> dict[str, Any]:
    """A read of an unsharded collection, sent whole to its shard (at mongos's time when it
    is a snapshot read)."""
    snapshot = _snapshot(router, ctx, [shard])
    if snapshot is None:
        return forward(router, ctx, shard)
    return forward(router, ctx, shard, readConcern=snapshot.concern(ctx))


def _empty_snapshot_reply(router: Router, ctx: CommandContext, ns: str) -> dict[str, Any]:
    """No database: no documents (at mongos's time when it is a snapshot read)."""
    snapshot = _snapshot(router, ctx, [])
    at = snapshot.at if snapshot is not None else None
    return cursor_reply(0, ns, CursorBatch([], exhausted=True, at_cluster_time=at), first=True)


@router_command("count", locks=False)
def count(router: Router, ctx: CommandContext) -> dict[str, Any]:
    coll = _collection(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}")
    if sharded is None:
        target = _unsharded_target(router, ctx, create=False)
        return {"n": 0} if target is None else forward(router, ctx, target)
    total = 0
    for shard in router.targets(sharded, ctx.body.get("query")):
        reply = _run(shard, ctx, _body(ctx, skip=_DROP, limit=_DROP))
        _raise_for(reply)
        total += int(reply.get("n", 0))
    total = max(0, total - int(ctx.body.get("skip") or 0))
    limit = int(ctx.body.get("limit") or 0)
    return {"n": min(total, abs(limit)) if limit else total}


@router_command("distinct", locks=False)
def distinct(router: Router, ctx: CommandContext) -> dict[str, Any]:
    coll = _collection(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}")
    if sharded is None:
        target = _unsharded_target(router, ctx, create=False)
        return {"values": []} if target is None else forward(router, ctx, target)
    values: list[Any] = []
    for shard in router.targets(sharded, ctx.body.get("query")):
        reply = _run(shard, ctx, _body(ctx))
        _raise_for(reply)
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
    _reject_transactions(ctx)
    sharded = router.table.sharded(f"{ctx.db}.{coll}") if coll else None
    if sharded is None:
        shard = _unsharded_target(router, ctx, create=False)
        if shard is None:
            shard = router.all_shards()[0]
        return _forward_read(router, ctx, shard)
    targets = router.targets(sharded, None)
    snapshot = _snapshot(router, ctx, targets)
    # the leading $match stages run on the shards (as mongos splits a pipeline), the rest here
    pushed = 0
    while pushed < len(pipeline) and _is_match(pipeline[pushed]):
        pushed += 1
    source: dict[str, Any] = {
        "aggregate": coll, "pipeline": pipeline[:pushed], "cursor": {"batchSize": _FIND_BATCH},
    }  # fmt: skip
    if snapshot is not None:
        source["readConcern"] = snapshot.concern(ctx)
    docs: list[Any] = []
    for shard in targets:
        docs.extend(_drain(shard, ctx, source))
    for name, spec in lite_parse(router.profile, pipeline[pushed:]):
        docs = _run_stage(docs, name, spec)
    cursor = body.get("cursor")
    size = cursor.get("batchSize") if isinstance(cursor, dict) else None
    ns = f"{ctx.db}.{coll}"
    return _buffered_reply(ctx, ns, docs, int(size) if size is not None else 101, snapshot)


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
    cursor = MergedChangeStream(router, ctx.db, coll, pipeline, spec, passthrough, _lsid(ctx))
    batch = cursor.open()
    cid = ctx.deployment.cursors.register(cursor, ctx.member.name)
    return cursor_reply(cid, cursor.ns, batch, first=True)


# ======================================================================================
# Catalog commands and DDL
# ======================================================================================


@router_command("listCollections", locks=False)
@router_command("listIndexes", locks=False)
def list_catalog(router: Router, ctx: CommandContext) -> dict[str, Any]:
    shard = _unsharded_target(router, ctx, create=False)
    if shard is None:
        if ctx.name == "listIndexes":
            raise CommandError(26, f"ns does not exist: {ctx.db}.{ctx.target}")
        return cursor_reply(0, f"{ctx.db}.$cmd.listCollections", CursorBatch([]), first=True)
    return forward(router, ctx, shard)


@router_command("listDatabases", admin_only=True, locks=False)
def list_databases(router: Router, ctx: CommandContext) -> dict[str, Any]:
    sizes: dict[str, int] = {}
    for shard in router.all_shards():
        reply = shard.command("admin", _body(ctx))
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
        sharded = router.table.sharded(f"{ctx.db}.{_collection(ctx)}")
        if sharded is not None:
            router.cluster.mirror_collection(sharded.ns)
        return out


@router_command("drop", locks=False)
def drop(router: Router, ctx: CommandContext) -> dict[str, Any]:
    coll = _collection(ctx)
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


# ======================================================================================
# Sharding commands
# ======================================================================================


def _ns_arg(ctx: CommandContext) -> tuple[str, str]:
    ns = ctx.target
    if not isinstance(ns, str) or "." not in ns:
        raise CommandError(73, f"Invalid namespace specified '{ns}'")
    db, coll = ns.split(".", 1)
    return db, coll


@router_command("enableSharding", "enablesharding", admin_only=True, locks=False)
def enable_sharding(router: Router, ctx: CommandContext) -> dict[str, Any]:
    db = ctx.target
    if not isinstance(db, str) or not db:
        raise CommandError(73, f"invalid db name specified: {db}")
    primary = ctx.body.get("primaryShard")
    with router.cluster.ddl_lock:
        if isinstance(primary, str):
            if primary not in router.table.shard_names():
                raise CommandError(70, f"Shard {primary} not found")
            with router.table.lock:
                router.table.databases.setdefault(db, primary)
            router.cluster.record_database(db, router.table.databases[db])
        else:
            router.primary_shard(db, create=True)
        router.table.sharding_enabled.add(db)
    return {}


@router_command("shardCollection", "shardcollection", admin_only=True, locks=False)
def shard_collection(router: Router, ctx: CommandContext) -> dict[str, Any]:
    db, coll = _ns_arg(ctx)
    key = ctx.body.get("key")
    if not isinstance(key, dict) or not key:
        raise CommandError(
            40414, "BSON field 'shardCollection.key' is missing but a required field"
        )
    for _name, kind in key.items():
        if kind not in (1, 1.0, "hashed"):
            raise CommandError(
                2, f"Unsupported shard key pattern {key}: values must be 1 or 'hashed'"
            )
    if sum(kind == "hashed" for kind in key.values()) > 1:
        raise CommandError(31303, "A shard key pattern only allows one hashed field")
    unique = ctx.body.get("unique") is True
    with router.cluster.ddl_lock:
        if router.profile.major_minor < (6, 0) and db not in router.table.sharding_enabled:
            raise CommandError(20, f"sharding not enabled for db {db}")
        existing = router.table.sharded(f"{db}.{coll}")
        if existing is not None:
            if existing.key == key:
                return {"collectionsharded": f"{db}.{coll}"}
            raise CommandError(
                20, f"sharding already enabled for collection {db}.{coll} with options "
                f"{{ shardKey: {existing.key} }}"
            )  # fmt: skip
        router.cluster.shard_collection(router, db, coll, key, unique)
    out: dict[str, Any] = {"collectionsharded": f"{db}.{coll}"}
    return out


@router_command("split", admin_only=True, locks=False)
def split(router: Router, ctx: CommandContext) -> dict[str, Any]:
    db, coll = _ns_arg(ctx)
    with router.cluster.ddl_lock:
        sharded = router.table.sharded(f"{db}.{coll}")
        if sharded is None:
            raise CommandError(118, f"ns {db}.{coll} is not sharded")
        if "middle" in ctx.body:
            point = parse_key_document(sharded, ctx.body["middle"], "middle")
        else:
            raise CommandError(2, "the simulator's split needs 'middle'")
        with router.table.lock:
            chunk = sharded.chunk_for(point)
            if compare_keys(chunk.min, point) == 0:
                raise CommandError(
                    2,
                    f"cannot split on initial or final chunk's key {key_document(sharded, point)}",
                )
            index = sharded.chunks.index(chunk)
            sharded.chunks[index : index + 1] = [
                Chunk(chunk.min, point, chunk.shard), Chunk(point, chunk.max, chunk.shard)
            ]  # fmt: skip
        router.cluster.record_chunks(sharded)
    return {}


@router_command("moveChunk", "movechunk", admin_only=True, locks=False)
def move_chunk(router: Router, ctx: CommandContext) -> dict[str, Any]:
    db, coll = _ns_arg(ctx)
    to = ctx.body.get("to")
    if not isinstance(to, str) or to not in router.table.shard_names():
        raise CommandError(70, f"Could not find shard {to}")
    with router.cluster.ddl_lock:
        sharded = router.table.sharded(f"{db}.{coll}")
        if sharded is None:
            raise CommandError(118, f"ns {db}.{coll} is not sharded")
        if "find" in ctx.body:
            chunk = sharded.chunk_for(parse_key_document(sharded, ctx.body["find"], "find"))
        elif isinstance(ctx.body.get("bounds"), list) and len(ctx.body["bounds"]) == 2:
            low = parse_key_document(sharded, ctx.body["bounds"][0], "bounds")
            chunk = sharded.chunk_for(low)
            if compare_keys(chunk.min, low) != 0:
                raise CommandError(2, "no chunk starts at the given bounds")
        else:
            raise CommandError(2, "moveChunk needs 'find' or 'bounds'")
        if chunk.shard != to:
            router.cluster.move_chunk(sharded, chunk, to)
    return {"millis": 0}


@router_command("movePrimary", "moveprimary", admin_only=True, locks=False)
def move_primary(router: Router, ctx: CommandContext) -> dict[str, Any]:
    db = ctx.target
    to = ctx.body.get("to")
    if not isinstance(db, str) or not isinstance(to, str):
        raise CommandError(2, "movePrimary needs a database name and 'to'")
    if to not in router.table.shard_names():
        raise CommandError(70, f"Could not find shard {to}")
    with router.cluster.ddl_lock:
        router.cluster.move_primary(db, to)
    return {}


@router_command("addShard", "addshard", admin_only=True, locks=False)
def add_shard(router: Router, ctx: CommandContext) -> dict[str, Any]:
    host = ctx.target
    if not isinstance(host, str):
        raise CommandError(2, "addShard needs a connection string")
    name = router.cluster.add_shard_by_host(host)
    return {"shardAdded": name}


@router_command("listShards", "listshards", admin_only=True, locks=False)
def list_shards(router: Router, ctx: CommandContext) -> dict[str, Any]:
    return {"shards": router.cluster.shard_documents()}


@router_command("flushRouterConfig", "flushrouterconfig", locks=False)
@router_command("balancerStop", "balancerStart", admin_only=True, locks=False)
def no_op(router: Router, ctx: CommandContext) -> dict[str, Any]:
    return {}


@router_command("refineCollectionShardKey", "reshardCollection", admin_only=True, locks=False)
def reshard(router: Router, ctx: CommandContext) -> dict[str, Any]:
    """Key changes: the routing key changes at once (no data copy) and the primary
    shard logs the event change streams show with showExpandedEvents."""
    db, coll = _ns_arg(ctx)
    key = ctx.body.get("key")
    if not isinstance(key, dict) or not key:
        raise CommandError(40414, f"BSON field '{ctx.name}.key' is missing but a required field")
    with router.cluster.ddl_lock:
        sharded = router.table.sharded(f"{db}.{coll}")
        if sharded is None:
            raise CommandError(118, f"ns {db}.{coll} is not sharded")
        if ctx.name == "refineCollectionShardKey" and list(key)[: len(sharded.key)] != list(
            sharded.key
        ):
            raise CommandError(
                2, "refineCollectionShardKey: the new key must extend the current one"
            )
        router.cluster.change_key(sharded, key, ctx.name)
    return {}
