"""A simulated deployment's state: its members, and everything they share.

Every piece of state of one deployment lives on its :class:`Deployment` (or on
one :class:`Member`): no module of the simulator keeps state of its own, so
several deployments in one process never affect each other. All members of a replica set see the same catalog and oplog (replication is
instantaneous in the simulator); what differs per member is its role
(primary or secondary), its failpoints, its cursors and its connections.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import bson
from bson.binary import UuidRepresentation
from bson.codec_options import CodecOptions
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from ..core.auth import Users
from ..core.clock import ClusterClock
from ..core.compression import CompressorSet, resolve
from ..core.cs_metrics import ChangeStreamMetrics
from ..core.cursors import CursorManager
from ..core.event_cache import CACHE_BYTES, EventCache
from ..core.failpoints import FailPointRegistry
from ..core.netstats import ListenerStats
from ..core.oplog import Oplog, OplogEntry
from ..core.versions import VersionProfile
from . import persist
from .catalog import Catalog
from .history import History
from .persist import DbPathLock
from .sessions import RetryableWrite, Transaction

DocumentLookup = Callable[[str, str, "uuid.UUID | None", dict[str, Any]], "dict[str, Any] | None"]
"""``(db, coll, collection UUID, documentKey) -> the current document or None``."""


class Member:
    """One mongod of the deployment (its address, role and failpoints)."""

    def __init__(self, deployment: Deployment, index: int, host: str = "127.0.0.1") -> None:
        from ..core.failpoints import FailPointRegistry

        self.deployment = deployment
        self.index = index
        self.host = host
        self.port = 0
        """Set once its listener is bound."""
        self.failpoints: FailPointRegistry = FailPointRegistry()
        self.compressors = CompressorSet(deployment.network_compressors)
        """The wire compressors it enables, with their byte counters."""
        self.process_id = ObjectId()
        """``topologyVersion.processId``; changes when the member restarts."""
        self.topology_counter = 0
        """``topologyVersion.counter``; bumped on every role change."""
        self.up = True
        """False while the member is killed (``ReplicaSet.kill_member``) or stopped."""
        self.quiescing = False
        """Shutting down in quiesce mode: hello fails with ShutdownInProgress."""
        self.shutting_down = False
        """Shutting down (quiesce mode or after): shutdown errors carry ``topologyVersion``."""
        self.server: ListenerStats | None = None
        """Its running listener (set by the server layer; None while it is not serving)."""

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_primary(self) -> bool:
        return self.deployment.primary is self

    def __repr__(self) -> str:
        role = "PRIMARY" if self.is_primary else "SECONDARY"
        return f"<Member {self.name} {role}>"


class Deployment:
    """One replica set (or standalone): data, oplog, clock, cursors, members.

    ``lock`` serialises command execution (mongod's concurrency is not what
    the simulator emulates); a getMore that waits for new oplog entries
    releases it while it waits.
    """

    def __init__(
        self,
        profile: VersionProfile,
        *,
        members: int = 1,
        set_name: str = "rs0",
        standalone: bool = False,
        oplog_max_entries: int | None = None,
        oplog_max_bytes: int | None = None,
        now: Callable[[], float] = time.time,
        compressors: Iterable[str] | str | None = None,
        event_cache_bytes: int = CACHE_BYTES,
        dbpath: str | os.PathLike[str] | None = None,
        users: Mapping[str, str] | Users | None = None,
        clock: ClusterClock | None = None,
    ) -> None:
        if standalone and members != 1:
            raise ValueError("a standalone has exactly one member")
        self.profile = profile
        self.standalone = standalone
        self.set_name: str | None = None if standalone else set_name
        self.lock = threading.RLock()
        self.clock = clock if clock is not None else ClusterClock(now)
        """Its own, or the one clock every shard of a sharded cluster shares."""
        self.oplog = Oplog(max_entries=oplog_max_entries, max_bytes=oplog_max_bytes)
        self.cursors = CursorManager()
        self.history = History(now)
        """Old document versions for point-in-time (snapshot) reads."""
        self.term = 1
        self.set_version = 1
        self.network_compressors = resolve(compressors)
        """``networkMessageCompressors`` of every member (None: mongod's default)."""
        self.members: list[Member] = [Member(self, i) for i in range(members)]
        self.primary: Member | None = self.members[0]
        self.catalog: Catalog = Catalog(self)
        self.started_at = now()
        self.sessions: dict[bytes, Transaction | RetryableWrite] = {}
        """The latest transaction or retryable write of every session (by ``lsid.id``)."""
        self.topology_changed = threading.Condition()
        """Notified whenever a member's role or topologyVersion changes, or a member goes down."""
        self.event_cache = EventCache(event_cache_bytes)
        """Change events already built from this oplog, shared by its streams."""
        self.cs_metrics = ChangeStreamMetrics(profile)
        """``serverStatus().metrics.changeStreams`` of this process (a mongos sets ``router``)."""
        self.fcv = profile.fcv
        """``featureCompatibilityVersion`` (``setFeatureCompatibilityVersion`` changes it;
        kept in the ``dbpath``, as mongod keeps it in ``admin.system.version``)."""
        self.placement_since = Timestamp(1, 0) if profile.precise_shard_targeting else None
        """A config server's: since when it records placement history (FCV 9.0+, from the
        start on a new 9.0 cluster; None: not recorded). Kept in the ``dbpath`` with the FCV."""
        self.users = users if isinstance(users, Users) else Users(users)
        """Who may authenticate, and whether commands need it (``--auth``); one shared by every
        mongos and shard of a sharded cluster."""
        self.document_lookup: DocumentLookup | None = None
        """On a shard: mongos's ``updateLookup``, targeted by ``documentKey`` (set by the
        cluster); None: look the document up in this deployment."""
        self.dbpath = None if dbpath is None else Path(dbpath)
        """Where :meth:`close` keeps the data for the next start (None: in memory only)."""
        self.generation: int | None = None
        """A sharded cluster's generation, recorded in this deployment's file at every clean
        stop of the cluster, so a file from another stop is told apart (None: not a shard or
        config server, or a file written before generations)."""
        self._dbpath_lock = None if self.dbpath is None else DbPathLock(self.dbpath)
        try:
            if self.dbpath is not None and persist.has_snapshot(self.dbpath):
                self._restart()
            else:
                self._initiate()
        except BaseException:
            self.close(save=False)
            raise

    def _restart(self) -> None:
        """Load the data kept in :attr:`dbpath`; a replica set then elects a primary (term + 1)."""
        assert self.dbpath is not None
        persist.restore(self, self.dbpath)
        self.history.restarted(self.last_applied())
        if not self.standalone:
            self.term += 1
            self.log("n", "", {"msg": "new primary"})

    def close(self, *, save: bool = True) -> None:
        """End the event cache's timer, write the data to :attr:`dbpath` (if any) and
        release it; idempotent."""
        self.event_cache.close()
        lock, self._dbpath_lock = self._dbpath_lock, None
        if lock is None:
            return
        try:
            if save and self.dbpath is not None:
                persist.save(self, self.dbpath)
        finally:
            lock.release()

    def _initiate(self) -> None:
        """Write the "initiating set" no-op every replica set's oplog begins with."""
        if not self.standalone:
            self.log("n", "", {"msg": "initiating set"})

    # -- the oplog -----------------------------------------------------------
    def log(
        self,
        op: str,
        ns: str,
        o: dict[str, Any],
        *,
        ui: uuid.UUID | None = None,
        o2: dict[str, Any] | None = None,
        lsid: dict[str, Any] | None = None,
        txn_number: int | None = None,
        stmt_id: int | None = None,
        txn_ops: list[OplogEntry] | None = None,
        pre_image: dict[str, Any] | None = None,
        post_image: dict[str, Any] | None = None,
        ts: Timestamp | None = None,
        wall: datetime | None = None,
    ) -> OplogEntry:
        """Stamp one entry with the next cluster time and append it.

        The caller holds :attr:`lock`. A standalone keeps no oplog, so there
        the entry is built (for its timestamp) but not stored.
        """
        entry = OplogEntry(
            ts=ts or self.clock.tick(),
            wall=wall or self.clock.wall(),
            op=op,
            ns=ns,
            o=o,
            ui=ui,
            o2=o2,
            t=self.term,
            lsid=lsid,
            txn_number=txn_number,
            stmt_id=stmt_id,
            txn_ops=txn_ops,
            pre_image=pre_image,
            post_image=post_image,
        )
        entry.size = _approx_size(entry)
        self.history.mark(entry.ts, catalog_change=_catalog_change(entry))
        if not self.standalone:
            self.oplog.append(entry)
        return entry

    def mark_unlogged_writes(self, at: Timestamp) -> None:
        """Writes made here without an oplog entry are visible to snapshot reads from ``at`` on.

        A chunk migration's copies and deletes, which mongod logs ``fromMigrate`` (hidden
        from change streams) at their own times; without a mark they stayed invisible to
        every read at a time before this deployment's next oplog entry. The caller holds
        :attr:`lock` and passes one new cluster time for every deployment the migration
        touched, so a read sees the documents on exactly one of them at any time.
        """
        self.history.mark(at)

    def last_applied(self) -> Timestamp:
        """The optime of the latest write (the read timestamp of a new read)."""
        return self.oplog.last_ts or self.clock.current()


def _catalog_change(entry: OplogEntry) -> uuid.UUID | None:
    """The collection an entry creates or renames (snapshot reads before it are refused)."""
    if entry.op == "c" and ("create" in entry.o or "renameCollection" in entry.o):
        return entry.ui
    return None


_SIZE_CODEC: CodecOptions[dict[str, Any]] = CodecOptions(
    uuid_representation=UuidRepresentation.STANDARD
)
"""Oplog entries hold native UUIDs (``dropTarget``, ``collectionOptions_old.uuid``)."""


def _approx_size(entry: OplogEntry) -> int:
    size = 64 + len(bson.encode(entry.o, codec_options=_SIZE_CODEC))
    if entry.o2 is not None:
        size += len(bson.encode(entry.o2, codec_options=_SIZE_CODEC))
    if entry.txn_ops:
        size += sum(e.size or _approx_size(e) for e in entry.txn_ops)
    return size
