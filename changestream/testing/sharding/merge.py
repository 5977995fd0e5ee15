"""mongos's change stream: one cursor per shard, merged in resume-token order.

As ``async_results_merger.cpp`` does it: each shard's ``postBatchResumeToken``
is its promise (the lowest token it can still send); an event is released only
when it sorts at or below the lowest promise of all shards, and that minimum is
mongos's own ``postBatchResumeToken``. An idle shard advances its promise only
through its periodic no-op writes, so it delays the other shards' events by up
to that interval, as on a real cluster.

The shards only check that the stream is resumable; mongos checks that the
client's resume token is there (``$_internalChangeStreamEnsureResumeTokenPresent``):
280 when the merged stream goes past it without it.

New shards: the simulator's config-server promise is the cluster time read
before each round of shard getMores (plus one tick); a shard added later gets
a later ``addShard`` time, and mongos opens a cursor on it from that time on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from bson.int64 import Int64
from bson.timestamp import Timestamp

from ..changestreams.pipeline import value_to_string
from ..changestreams.resume_token import encode_token, high_water_mark, is_high_water_mark
from ..changestreams.stage import CHANGE_STREAM, ChangeStreamSpec
from ..core.context import CLIENT_CHECK_SECONDS
from ..core.cursors import CursorBatch
from ..core.errors import CommandError
from .shards import Shard, remote_error

if TYPE_CHECKING:
    from ..core.context import CommandContext, ConnectionInfo
    from ..storage.deployment import Member
    from .router import Router

DEFAULT_AWAIT_MS: Final = 1000
MAX_BATCH_BYTES: Final = 16 * 1024 * 1024
_START_OPTIONS: Final = ("resumeAfter", "startAfter", "startAtOperationTime")


def _key(token: dict[str, Any]) -> str:
    """A token's sort key: its keystring hex (same case throughout, so it sorts as bytes)."""
    return str(token["_data"])


@dataclass(slots=True)
class _Remote:
    """mongos's cursor on one shard."""

    shard: Shard
    member: Member
    process_id: Any
    cid: int
    collection: str
    promise: dict[str, Any]
    buffer: deque[dict[str, Any]] = field(default_factory=deque)
    exhausted: bool = False


class MergedChangeStream:
    """The cursor mongos registers for a ``$changeStream`` aggregate."""

    is_change_stream = True
    tailable_await = True

    def __init__(
        self,
        router: Router,
        db: str,
        coll: str | None,
        pipeline: list[Any],
        spec: ChangeStreamSpec,
        passthrough: dict[str, Any],
        lsid_id: bytes | None,
    ) -> None:
        self.ns = spec.ns
        self.lsid_id = lsid_id
        self._router = router
        self._db = db
        self._target: Any = coll if coll is not None else 1
        self._pipeline = pipeline
        self._spec = spec
        self._passthrough = passthrough
        self._version = spec.token_version
        self._remotes: dict[str, _Remote] = {}
        self._wake = threading.Event()
        self._closed = False
        self._exhausted = False
        self._table_version = -1
        token = spec.resume_token
        self._check_token: str | None = None
        # startAfter an invalidate: the shard replays that invalidate, mongos skips it
        self._skip_through: str | None = None
        if token is not None and spec.resume_token_doc is not None:
            if not is_high_water_mark(token) and not token.from_invalidate:
                self._check_token = _key(spec.resume_token_doc)
            if token.from_invalidate:
                self._skip_through = _key(spec.resume_token_doc)
            self._start = token.cluster_time
            self._pbrt: dict[str, Any] = dict(spec.resume_token_doc)
        else:
            if spec.start_at_operation_time is not None:
                self._start = spec.start_at_operation_time
            else:  # one tick after the cluster time mongos knows
                now = router.clock.current()
                self._start = Timestamp(now.time, now.inc + 1)
            self._pbrt = encode_token(high_water_mark(self._start, self._version))
        self._token_found = False

    # -- opening -------------------------------------------------------------------------------
    def open(self) -> CursorBatch:
        """Open a cursor on every shard; mongos's first batch is always empty."""
        try:
            self._open_new_shards(initial=True)
        except BaseException:
            self.close()
            raise
        self._advance_pbrt()
        return CursorBatch([], post_batch_resume_token=self._pbrt)

    def _shard_pipeline(self, start: Timestamp | None) -> list[Any]:
        """The pipeline each shard runs (the client's, from ``start`` for a new shard)."""
        stages = []
        for stage in self._pipeline:
            if isinstance(stage, dict) and CHANGE_STREAM in stage:
                options = dict(stage[CHANGE_STREAM])
                if start is not None or not any(k in options for k in _START_OPTIONS):
                    for name in _START_OPTIONS:
                        options.pop(name, None)
                    options["startAtOperationTime"] = start or self._start
                stage = {CHANGE_STREAM: options}
            stages.append(stage)
        return stages

    def _open_new_shards(self, *, initial: bool = False) -> None:
        table = self._router.table
        if table.version == self._table_version:
            return
        with table.lock:
            version = table.version
            shards = list(table.shards)
        for info in shards:
            if info.name in self._remotes:
                continue
            shard = self._router.shard(info.name)
            start = None
            if not initial:
                added = info.added_at
                start = max(Timestamp(added.time, added.inc + 1), self._start, key=_ts_key)
            self._remotes[info.name] = self._open_remote(shard, start)
        self._table_version = version

    def _open_remote(self, shard: Shard, start: Timestamp | None) -> _Remote:
        body: dict[str, Any] = {
            "aggregate": self._target,
            "pipeline": self._shard_pipeline(start),
            "cursor": {},  # the shards' first batches are buffered: their resume checks run now
            "fromRouter": True,
            **self._passthrough,
        }
        member = shard.primary()
        reply = shard.run(self._db, body, member)
        if reply.get("ok") != 1.0:
            raise remote_error(reply, member.name)
        cursor = reply["cursor"]
        remote = _Remote(
            shard=shard,
            member=member,
            process_id=member.process_id,
            cid=int(cursor["id"]),
            collection=str(cursor["ns"]).split(".", 1)[1],
            promise=cursor["postBatchResumeToken"],
        )
        remote.buffer.extend(cursor.get("firstBatch", ()))
        shard.deployment.oplog.subscribe(self._wake)
        if remote.cid == 0:
            remote.exhausted = True
        return remote

    # -- getMore ---------------------------------------------------------------------------------
    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch:
        ctx.is_change_stream = True
        wait_ms = DEFAULT_AWAIT_MS if max_time_ms is None else max_time_ms
        deadline = time.monotonic() + wait_ms / 1000
        try:
            while True:
                self._wake.clear()
                cap = self._router.clock.current()
                self._open_new_shards()
                self._poll()
                batch = self._release(batch_size, Timestamp(cap.time, cap.inc + 1))
                if self._closed:
                    # Killed while this getMore ran (killCursors, a session kill): its
                    # shard cursors are gone, so what it computed may promise past events
                    # never sent. mongod interrupts the operation instead.
                    raise CommandError(237, "operation was interrupted")
                if batch.documents or batch.exhausted:
                    return batch
                left = deadline - time.monotonic()
                if left <= 0:
                    return batch
                self._wait(min(left, CLIENT_CHECK_SECONDS), ctx.connection)
        except BaseException:
            self.close()
            raise

    def _wait(self, seconds: float, conn: ConnectionInfo) -> None:
        self._wake.wait(seconds)
        if self._closed:
            raise CommandError(237, "operation was interrupted")
        conn.check_connected()

    def _poll(self) -> None:
        """A getMore on every shard that has nothing buffered, without waiting."""
        for remote in self._remotes.values():
            if remote.exhausted or remote.buffer:
                continue
            member = remote.member
            if member.process_id != remote.process_id or not member.up or member.server is None:
                raise CommandError(
                    6,
                    f"Error on remote shard {member.name} :: caused by :: "
                    "Connection closed by peer",
                )
            reply = remote.shard.run(
                self._db,
                {"getMore": Int64(remote.cid), "collection": remote.collection, "maxTimeMS": 0},
                member,
            )
            if reply.get("ok") != 1.0:
                remote.exhausted = True
                raise remote_error(reply, member.name)
            cursor = reply["cursor"]
            remote.buffer.extend(cursor.get("nextBatch", ()))
            token = cursor.get("postBatchResumeToken")
            if token is not None:
                remote.promise = token
            if not cursor.get("id"):
                remote.exhausted = True

    def _release(self, limit: int | None, cap: Timestamp) -> CursorBatch:
        """Hand out what sorts at or below every shard's promise, in token order."""
        remotes = list(self._remotes.values())
        cap_token = encode_token(high_water_mark(cap, self._version))
        promise = min([r.promise for r in remotes] + [cap_token], key=_key)
        bound = _key(promise)
        docs: list[dict[str, Any]] = []
        size = 0
        more = False
        while limit is None or len(docs) < limit:
            heads = [r for r in remotes if r.buffer]
            if not heads:
                break
            remote = min(heads, key=lambda r: _key(r.buffer[0]["_id"]))
            doc = remote.buffer[0]
            key = _key(doc["_id"])
            if key > bound:
                break
            doc_size = len(getattr(doc, "raw", b"")) or 64
            if docs and size + doc_size > MAX_BATCH_BYTES:
                more = True
                break
            remote.buffer.popleft()
            if self._skip_through is not None and key <= self._skip_through:
                continue
            if self._check_token is not None and not self._resume_point(key, doc):
                continue
            docs.append(doc)
            size += doc_size
            if doc.get("operationType") == "invalidate":
                self._exhausted = True
                self._pbrt = doc["_id"]
                self._close_remotes()
                return CursorBatch(
                    docs,
                    exhausted=True,
                    post_batch_resume_token=self._pbrt,
                    invalidated=self._router.profile.invalidated_flag,
                )
        else:
            more = True
        if docs and more:
            self._pbrt = docs[-1]["_id"]
        else:
            self._advance_pbrt(promise)
        return CursorBatch(docs, post_batch_resume_token=self._pbrt)

    def _resume_point(self, key: str, doc: dict[str, Any]) -> bool:
        """Ensure the client's resume token is present; False to drop ``doc``."""
        token = self._check_token
        assert token is not None
        if key < token:
            return False
        if key == token:
            self._token_found = True
            return False
        self._check_token = None
        if not self._token_found:
            raise CommandError(
                280,
                "cannot resume stream; the resume token was not found. "
                + value_to_string(doc["_id"]),
            )
        return True

    def _advance_pbrt(self, promise: dict[str, Any] | None = None) -> None:
        if promise is None:
            if not self._remotes:
                return
            promise = min((r.promise for r in self._remotes.values()), key=_key)
        if self._check_token is not None and _key(promise) < self._check_token:
            return  # not past the client's token yet: it stays the resume point
        heads = [r.buffer[0]["_id"] for r in self._remotes.values() if r.buffer]
        if heads and min(_key(h) for h in heads) <= _key(promise):
            return  # events at or below it are still buffered here: they come first
        if _key(promise) > _key(self._pbrt):
            self._pbrt = promise

    # -- closing ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._close_remotes()

    def _close_remotes(self) -> None:
        remotes, self._remotes = list(self._remotes.values()), {}
        for remote in remotes:
            remote.shard.deployment.oplog.unsubscribe(self._wake)
            if remote.exhausted:
                continue
            with contextlib.suppress(CommandError):
                remote.shard.run(
                    self._db,
                    {"killCursors": remote.collection, "cursors": [Int64(remote.cid)]},
                    remote.member,
                )


def _ts_key(ts: Timestamp) -> tuple[int, int]:
    return (ts.time, ts.inc)
