"""How mongos sends a command to a shard and turns the replies into its own.

A command for an unsharded collection goes whole to one shard (:func:`forward`);
the shard's cursor becomes a :class:`RemoteCursor` of this mongos. Reads of a
sharded collection are gathered here (:func:`drain`) and served from a
:class:`BufferedCursor`. A snapshot read pins every shard to one cluster time
(:class:`SnapshotTarget`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bson.int64 import Int64
from bson.timestamp import Timestamp

from ...core.context import CommandContext
from ...core.cursors import CursorBatch, cursor_reply
from ...core.errors import CommandError
from ..shards import Shard

if TYPE_CHECKING:
    from ..router import Router

FIND_BATCH = 1_000_000
"""The batch size mongos asks the shards for when it gathers a whole result here."""


def strip_reply(reply: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in reply.items() if k not in ("ok", "$clusterTime", "operationTime")}


def raise_for(reply: dict[str, Any]) -> None:
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


def shard_body(ctx: CommandContext, **changes: Any) -> dict[str, Any]:
    body = {k: v for k, v in ctx.body.items() if k not in ("$db", "$clusterTime")}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not DROP}


DROP: Any = object()
"""A value of :func:`shard_body`'s ``changes`` that removes the field."""


def run_on(shard: Shard, ctx: CommandContext, body: dict[str, Any]) -> dict[str, Any]:
    reply = shard.run(ctx.db, body)
    if isinstance(reply.get("operationTime"), Timestamp):
        ctx.operation_time = max(
            ctx.operation_time or reply["operationTime"], reply["operationTime"],
            key=lambda ts: (ts.time, ts.inc),
        )  # fmt: skip
    return reply


def forward(router: Router, ctx: CommandContext, shard: Shard, **changes: Any) -> dict[str, Any]:
    """Send the command to one shard; its reply (a cursor wrapped in a mongos cursor)."""
    reply = run_on(shard, ctx, shard_body(ctx, **changes))
    raise_for(reply)
    out = strip_reply(reply)
    cursor = out.get("cursor")
    if isinstance(cursor, dict) and cursor.get("id"):
        remote = RemoteCursor(shard, ctx.db, str(cursor["ns"]), int(cursor["id"]), session_id(ctx))
        remote.session = ctx.lsid
        cid = ctx.deployment.cursors.register(remote, ctx.member.name)
        out["cursor"] = {**cursor, "id": Int64(cid)}
    return out


def session_id(ctx: CommandContext) -> bytes | None:
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
        raise_for(reply)
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


def buffered_reply(
    ctx: CommandContext,
    ns: str,
    docs: list[Any],
    batch_size: int | None,
    snapshot: SnapshotTarget | None = None,
) -> dict[str, Any]:
    size = len(docs) if batch_size is None else batch_size
    cursor = BufferedCursor(ns, docs[size:], session_id(ctx), snapshot)
    batch = CursorBatch(
        docs[:size],
        exhausted=not cursor.remaining,
        at_cluster_time=snapshot.at if snapshot is not None else None,
    )
    cid = 0 if batch.exhausted else ctx.deployment.cursors.register(cursor, ctx.member.name)
    return cursor_reply(cid, ns, batch, first=True)


def drain(shard: Shard, ctx: CommandContext, body: dict[str, Any]) -> list[Any]:
    """Every document of a cursor command on one shard."""
    reply = run_on(shard, ctx, body)
    raise_for(reply)
    cursor = reply["cursor"]
    docs = list(cursor.get("firstBatch", ()))
    collection = str(cursor["ns"]).split(".", 1)[1]
    cid = cursor.get("id")
    while cid:
        reply = shard.run(ctx.db, {"getMore": Int64(cid), "collection": collection})
        raise_for(reply)
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


def snapshot_target(
    router: Router, ctx: CommandContext, shards: list[Shard]
) -> SnapshotTarget | None:
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


def collection_name(ctx: CommandContext) -> str:
    target = ctx.target
    if not isinstance(target, str) or not target:
        raise CommandError(73, f"Invalid namespace specified '{ctx.db}.{target}'")
    return target


def reject_transactions(ctx: CommandContext) -> None:
    if ctx.autocommit is not None or ctx.start_transaction:
        raise CommandError(
            263, "the simulator's mongos does not run transactions; use a replica set"
        )


def unsharded_target(router: Router, ctx: CommandContext, *, create: bool) -> Shard | None:
    if ctx.db == "config":
        return router.config
    return router.primary_shard(ctx.db, create=create)
