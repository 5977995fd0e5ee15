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

Reader versions (``_determineChangeStreamReaderVersion``): v1 reads every shard; v2 (9.0 at
FCV 9.0, unless ``version: "v1"``) reads only the shards that can hold data the stream
sees (``data_shards``), opened on the first pull of the pipeline (the aggregate's, or the
first getMore's after ``batchSize: 0``), and opens more at each placement change that
concerns it (chunk moves, ``movePrimary``, the database's creation), from that change's
time. Cluster-wide v2 streams read every shard, as v1.
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

V1: Final = "v1"
V2: Final = "v2"

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
    retired: bool = False
    """v2: the shard no longer holds the stream's data; dropped once its buffer is empty."""


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
        *,
        first_batch_size: int | None = None,
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
        self._coll = coll
        self.reader = self._choose_reader()
        """``"v1"`` or ``"v2"``: how this stream targets shards."""
        self._deferred = self.reader == V2 and first_batch_size == 0
        """v2 opens its shard cursors on the first pull: none with ``batchSize: 0``."""
        self._placement_seen = 0

    def _choose_reader(self) -> str:
        """``_determineChangeStreamReaderVersion`` on mongos: v2 needs the feature flag (9.0
        at FCV 9.0) and placement history at the start time; an explicit v1 is honoured."""
        cluster = self._router.cluster
        since = cluster.placement_since
        if not self._router.profile.precise_shard_targeting or since is None:
            return V1
        if self._spec.reader_version == V1 or _ts_key(self._start) < _ts_key(since):
            return V1
        return V2

    # -- opening -------------------------------------------------------------------------------
    def open(self) -> CursorBatch:
        """Open a cursor on every shard (v2: on those it needs); the first batch is empty.

        v2 targets shards (and finds removed ones) on the first pull of the stage: inside
        the aggregate, or at the first getMore after ``batchSize: 0``."""
        if self.reader == V2:
            self._count_targeter_scope()
        if self._deferred:
            return CursorBatch([], post_batch_resume_token=self._pbrt)
        self._check_removed_shards()
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

    def _check_removed_shards(self) -> None:
        """v1: no shard may have been removed since the start (286, sharded_agg_helpers.cpp);
        v2 strict: no shard that held data it must read (mongod: ShardRemovedError, here
        ShardNotFound, 70: see docs/testing.md); v2 with ``ignoreRemovedShards``: skip them."""
        removed = self._router.cluster.removed_since(self._start)
        if not removed:
            return
        if self.reader == V1:
            raise CommandError(286, "Change stream events no more available due to removed shard")
        if self._spec.ignore_removed_shards:
            return
        db = "admin" if self._spec.cluster else self._db
        for shard in removed:
            if shard.held(db, self._coll):
                raise CommandError(
                    70,
                    "unable to establish all necessary cursors as at least one required shard "
                    f"has been removed. Shard {shard.name} does not exist",
                )

    def _count_targeter_scope(self) -> None:
        metrics = self._router.cluster_metrics
        if self._spec.cluster:
            metrics.add("shardTargeting.targeterScope.allDatabases")
            return
        present = self._router.table.primary_of(self._db) is not None
        scope = "collection" if self._coll is not None else "database"
        metrics.add(
            f"shardTargeting.targeterScope.{scope}.{'dbPresent' if present else 'dbAbsent'}"
        )

    def _open_targeted_shards(self, *, initial: bool) -> None:
        """v2: cursors on the shards that can hold the stream's data, more as it moves."""
        table = self._router.table
        with table.lock:
            changes = table.placement[self._placement_seen :]
            self._placement_seen = len(table.placement)
            wanted = table.data_shards(self._db, self._coll)
        mine = [  # a database stream sees every collection of its database
            c for c in changes
            if c.db == self._db and (self._coll is None or c.coll in (None, self._coll))
        ]  # fmt: skip
        if initial and any(_ts_key(c.at) > _ts_key(self._start) for c in mine):
            with table.lock:  # resuming across moves of its own data: every shard
                wanted = set(table.shard_names())
        if not initial:
            for change in mine:
                self._router.cluster_metrics.add(f"shardTargeting.controlEvents.{change.kind}")
        if not initial and mine:
            last = max((c.at for c in mine), key=_ts_key)
            for name in [n for n, r in self._remotes.items() if n not in wanted and not r.retired]:
                self._retire(self._remotes[name], last)
        new = sorted(wanted - set(self._remotes))
        if not new:
            return
        start = None
        if not initial:
            first = min((c.at for c in mine or changes), key=_ts_key, default=self._start)
            start = max(first, self._start, key=_ts_key)
        for name in new:
            self._remotes[name] = self._open_remote(self._router.shard(name), start)

    def _retire(self, remote: _Remote, at: Timestamp) -> None:
        """Close the cursor of a shard that stopped holding the stream's data at ``at``:
        what it had is buffered, and it promises nothing more below ``at`` (the control
        event on its oplog says so on a real shard)."""
        if not remote.exhausted:
            self._poll_one(remote)
            self._kill_remote(remote)
        remote.exhausted = remote.retired = True
        limit = encode_token(high_water_mark(at, self._version))
        if _key(limit) > _key(remote.promise):
            remote.promise = limit

    def _open_new_shards(self, *, initial: bool = False) -> None:
        if self.reader == V2 and not self._spec.cluster:
            self._open_targeted_shards(initial=initial)
            return
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
            if self.reader == V2 and self._router.cluster.placement_since is None:
                # the FCV went below 9.0: the targeter switches to v1 (kDowngrading); the
                # driver resumes and mongos then picks v1
                raise CommandError(234, "Downgrading change stream reader to v1 version")
            if self._deferred:
                self._deferred = False
                self._check_removed_shards()
                self._open_new_shards(initial=True)
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
        for name, remote in list(self._remotes.items()):
            if remote.retired and not remote.buffer:
                del self._remotes[name]
                remote.shard.deployment.oplog.unsubscribe(self._wake)
                continue
            if remote.exhausted or remote.buffer:
                continue
            self._poll_one(remote)

    def _poll_one(self, remote: _Remote) -> None:
        member = remote.member
        if member.process_id != remote.process_id or not member.up or member.server is None:
            raise CommandError(
                6,
                f"Error on remote shard {member.name} :: caused by :: Connection closed by peer",
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
            if not remote.exhausted:
                self._kill_remote(remote)

    def _kill_remote(self, remote: _Remote) -> None:
        with contextlib.suppress(CommandError):
            remote.shard.run(
                self._db,
                {"killCursors": remote.collection, "cursors": [Int64(remote.cid)]},
                remote.member,
            )


def _ts_key(ts: Timestamp) -> tuple[int, int]:
    return (ts.time, ts.inc)
