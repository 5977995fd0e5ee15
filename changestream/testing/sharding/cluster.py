"""``ShardedCluster``: shards (independent replica sets), a config server, mongoses
and optionally a load balancer, all on loopback in this process.

>>> with ShardedCluster("8.0", shards=2, mongoses=2) as cluster:
...     client = pymongo.MongoClient(cluster.uri)

Every shard is its own :class:`~changestream.testing.ReplicaSet` (own catalog,
oplog, cursors, failpoints, ``step_down()``); they share one cluster clock, as
a real cluster's gossip keeps them in step. Each mongos is a server of its own
(own cursors, own failpoints) that routes through the shards' command layer
in-process. ``ClusterState`` holds what mongos would read from the config
server and the migrations (chunk moves, primary moves) the cluster performs.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from bson.int64 import Int64
from bson.objectid import ObjectId

from ..core.auth import Users
from ..core.clock import ClusterClock
from ..core.context import ConnectionInfo
from ..core.cursors import CursorManager
from ..core.oplog import Oplog
from ..core.versions import DEFAULT_VERSION, VersionProfile, get_profile
from ..replset import ReplicaSet
from ..server.dispatch import Dispatcher
from ..server.listener import MemberServer
from ..server.transport import Connection
from ..server.wire import Request
from ..storage.catalog import CollectionState
from ..storage.deployment import Deployment
from ..storage.order import id_key
from ..storage.persist import DbPathError
from .balancer import LoadBalancer
from .commands import registry_for
from .router import Router
from .routing import Chunk, RoutingTable, ShardedCollection, ShardInfo, compare_keys
from .shards import Shard

_PORT_ATTEMPTS = 20
LB_CONNECTION_IDS = 1_000_000_001
"""First ``connectionId`` on a mongos's load-balancer listener (each listener counts its own)."""


class ClusterState:
    """What every mongos of one cluster shares: the routing table, the shards, the clock."""

    def __init__(
        self, profile: VersionProfile, clock: ClusterClock, config: ReplicaSet, users: Users
    ) -> None:
        self.profile = profile
        self.clock = clock
        self.config = config
        self.users = users
        """The cluster's users (on the config server), shared by every mongos and shard."""
        self.table = RoutingTable()
        self.ddl_lock = threading.RLock()
        self._replica_sets: dict[str, ReplicaSet] = {}
        self.pending: dict[str, ReplicaSet] = {}
        """Replica sets started for the cluster but not added yet (``addShard`` takes them)."""
        self._config_shard = Shard("config", config)
        self._lock = threading.Lock()
        self._lb_connections: set[tuple[str, int]] = set()
        """(mongos, connectionId) of the connections that came through the load balancer."""
        self._conn_cursors: dict[tuple[str, int], list[tuple[CursorManager, int]]] = {}

    # -- shards ------------------------------------------------------------------------------
    def replica_set(self, name: str) -> ReplicaSet:
        return self._replica_sets[name]

    def replica_sets(self) -> list[ReplicaSet]:
        names = self.table.shard_names()
        return [self._replica_sets[name] for name in names]

    def add_shard(self, name: str, rs: ReplicaSet, *, restored: ShardInfo | None = None) -> str:
        """Register a started replica set as shard ``name`` (``addShard``; ``restored``: a
        shard the config server already lists, at a restart of the cluster)."""
        with self.ddl_lock:
            if name in self._replica_sets:
                raise ValueError(f"shard {name} already exists")
            rs.deployment.document_lookup = self.lookup
            self._replica_sets[name] = rs
            if restored is not None:
                with self.table.lock:
                    self.table.shards.append(restored)
                    self.table.version += 1
                return name
            added_at = self.clock.tick()
            with self.table.lock:
                self.table.shards.append(ShardInfo(name, added_at))
                self.table.version += 1
            host = f"{name}/" + ",".join(rs.members)
            self._config_shard.command(
                "config",
                {"insert": "shards", "documents": [
                    {"_id": name, "host": host, "state": 1, "topologyTime": added_at}
                ]},
            )  # fmt: skip
            for other in self._replica_sets.values():
                other.deployment.oplog.notify()  # mongos's new-shard monitor
        return name

    def add_shard_by_host(self, host: str) -> str:
        set_name = host.split("/", 1)[0]
        rs = self.pending.pop(set_name, None)
        if rs is None:
            for name, candidate in list(self.pending.items()):
                if any(member in host for member in candidate.members):
                    rs = self.pending.pop(name)
                    set_name = name
                    break
        if rs is None:
            raise_unknown_host(host)
        assert rs is not None
        return self.add_shard(set_name, rs)

    def shard_documents(self) -> list[dict[str, Any]]:
        with self.table.lock:
            infos = list(self.table.shards)
        return [
            {
                "_id": info.name,
                "host": f"{info.name}/" + ",".join(self._replica_sets[info.name].members),
                "state": 1,
                "topologyTime": info.added_at,
            }
            for info in infos
        ]

    # -- load-balanced connections -----------------------------------------------------------
    def mark_load_balanced(self, mongos: str, conn_id: int) -> None:
        with self._lock:
            self._lb_connections.add((mongos, conn_id))

    def is_load_balanced(self, mongos: str, conn_id: int) -> bool:
        with self._lock:
            return (mongos, conn_id) in self._lb_connections

    def track_cursor(self, mongos: str, conn_id: int, cursors: CursorManager, cid: int) -> None:
        with self._lock:
            if (mongos, conn_id) in self._lb_connections:
                self._conn_cursors.setdefault((mongos, conn_id), []).append((cursors, cid))

    def connection_closed(self, mongos: str, conn_id: int) -> None:
        """mongos kills a load-balanced connection's cursors when it closes."""
        with self._lock:
            self._lb_connections.discard((mongos, conn_id))
            owned = self._conn_cursors.pop((mongos, conn_id), [])
        for cursors, cid in owned:
            cursors.kill(cid, mongos)

    # -- config documents ----------------------------------------------------------------------
    def record_database(self, db: str, primary: str, *, partitioned: bool = False) -> None:
        changes: dict[str, Any] = {"primary": primary}
        if partitioned:
            changes["partitioned"] = True
        self._config_shard.command(
            "config",
            {"update": "databases", "updates": [{
                "q": {"_id": db}, "u": {"$set": changes}, "upsert": True
            }]},
        )  # fmt: skip

    def restored_shards(self) -> list[ShardInfo]:
        """The shards the config server lists (a cluster restarted from its ``dbpath``)."""
        docs = self._config_docs("shards")
        return [ShardInfo(str(doc["_id"]), doc["topologyTime"]) for doc in docs]

    def restore_routing(self) -> None:
        """Rebuild the routing table from the config server's documents (after the shards
        were restored): what a restarted mongos reads from the config server."""
        databases = self._config_docs("databases")
        collections = self._config_docs("collections")
        chunks = self._config_docs("chunks")
        with self.table.lock:
            for doc in databases:
                self.table.databases[str(doc["_id"])] = str(doc["primary"])
                if doc.get("partitioned") is True:
                    self.table.sharding_enabled.add(str(doc["_id"]))
            for doc in collections:
                ns, key = str(doc["_id"]), dict(doc["key"])
                fields = list(key)
                owned = [
                    Chunk(tuple(c["min"][f] for f in fields), tuple(c["max"][f] for f in fields),
                          str(c["shard"]))
                    for c in chunks if c["uuid"] == doc["uuid"]
                ]  # fmt: skip
                raw = doc["uuid"]
                ui = raw if isinstance(raw, uuid.UUID) else uuid.UUID(bytes=bytes(raw))
                sharded = ShardedCollection(ns, key, ui, bool(doc["unique"]), owned)
                self.table.collections[ns] = sharded
                self.table.sharding_enabled.add(ns.split(".", 1)[0])
        for sharded in list(self.table.collections.values()):
            db, coll = sharded.ns.split(".", 1)
            for rs in self.replica_sets():
                with rs.deployment.lock:
                    state = rs.deployment.catalog.get(db, coll)
                    if state is not None:
                        state.shard_key = sharded.fields

    def _config_docs(self, coll: str) -> list[dict[str, Any]]:
        deployment = self.config.deployment
        with deployment.lock:
            state = deployment.catalog.get("config", coll)
            return [] if state is None else [dict(doc) for doc in state.iter_stored()]

    def record_collection(self, sharded: ShardedCollection) -> None:
        self._config_shard.command(
            "config",
            {"update": "collections", "updates": [{
                "q": {"_id": sharded.ns},
                "u": {"_id": sharded.ns, "uuid": sharded.uuid, "key": sharded.key,
                      "unique": sharded.unique},
                "upsert": True,
            }]},
        )  # fmt: skip
        self.record_chunks(sharded)

    def record_chunks(self, sharded: ShardedCollection) -> None:
        fields = sharded.fields
        docs = [
            {"_id": ObjectId(), "uuid": sharded.uuid, "min": dict(zip(fields, c.min, strict=True)),
             "max": dict(zip(fields, c.max, strict=True)), "shard": c.shard}
            for c in sharded.chunks
        ]  # fmt: skip
        self._config_shard.command(
            "config", {"delete": "chunks", "deletes": [{"q": {"uuid": sharded.uuid}, "limit": 0}]}
        )
        self._config_shard.command("config", {"insert": "chunks", "documents": docs})

    # -- DDL and migrations ------------------------------------------------------------------
    def shard_collection(
        self, router: Router, db: str, coll: str, key: dict[str, Any], unique: bool
    ) -> None:
        ns = f"{db}.{coll}"
        primary = router.primary_shard(db, create=True)
        assert primary is not None
        deployment = primary.deployment
        with deployment.lock:
            exists = deployment.catalog.get(db, coll) is not None
        if not exists:
            primary.command(db, {"create": coll})
        if list(key) != ["_id"]:
            name = "_".join(f"{k}_{v}" for k, v in key.items())
            with contextlib.suppress(Exception):
                primary.command(
                    db, {"createIndexes": coll, "indexes": [{"key": key, "name": name}]}
                )
        with deployment.lock:
            state = deployment.catalog.get(db, coll)
            assert state is not None
            sharded = ShardedCollection(
                ns, dict(key), state.uuid, unique, self.table.initial_chunks(key, primary.name)
            )
            state.shard_key = sharded.fields
        with self.table.lock:
            self.table.collections[ns] = sharded
            self.table.sharding_enabled.add(db)
        for rs in self.replica_sets():
            if rs is not primary.replica_set:
                _ensure_copy(rs.deployment, state)
        for chunk in sharded.chunks:
            if chunk.shard != primary.name:
                self._migrate(sharded, chunk, primary.name, chunk.shard)
        o2: dict[str, Any] = {"shardCollection": ns, "shardKey": dict(key), "unique": unique}
        if self.profile.major_minor < (7, 0):
            o2["numInitialChunks"] = Int64(0)
        o2["presplitHashedZones"] = False
        with deployment.lock:
            deployment.log("n", ns, {"msg": {"shardCollection": ns}}, ui=state.uuid, o2=o2)
        self.record_collection(sharded)

    def change_key(self, sharded: ShardedCollection, key: dict[str, Any], event: str) -> None:
        """refineCollectionShardKey / reshardCollection: new key, the primary logs the event."""
        old = dict(sharded.key)
        db, coll = sharded.ns.split(".", 1)
        primary_name = self.table.primary_of(db)
        assert primary_name is not None
        with self.table.lock:
            sharded.key = dict(key)
        for rs in self.replica_sets():
            with rs.deployment.lock:
                state = rs.deployment.catalog.get(db, coll)
                if state is not None:
                    state.shard_key = sharded.fields
        if event == "reshardCollection":
            owners = sharded.chunks
            sharded.chunks = self.table.initial_chunks(key, primary_name)
            for previous in {c.shard for c in owners}:
                for chunk in sharded.chunks:
                    if chunk.shard != previous:
                        self._migrate(sharded, chunk, previous, chunk.shard)
        o2: dict[str, Any] = {event: sharded.ns, "shardKey": dict(key), "oldShardKey": old}
        if event == "reshardCollection":
            o2 = {event: sharded.ns, "reshardUUID": uuid.uuid4(), "shardKey": dict(key),
                  "oldShardKey": old, "unique": sharded.unique}  # fmt: skip
        deployment = self._replica_sets[primary_name].deployment
        with deployment.lock:
            deployment.log("n", sharded.ns, {"msg": {event: sharded.ns}}, ui=sharded.uuid, o2=o2)
        self.record_collection(sharded)

    def move_chunk(self, sharded: ShardedCollection, chunk: Chunk, to: str) -> None:
        source = chunk.shard
        with self.table.lock:
            chunk.shard = to
        self._migrate(sharded, chunk, source, to)
        self.record_chunks(sharded)

    def _migrate(self, sharded: ShardedCollection, chunk: Chunk, source: str, to: str) -> None:
        """Move the chunk's documents, invisibly to change streams (``fromMigrate``)."""
        db, coll = sharded.ns.split(".", 1)
        src = self._replica_sets[source].deployment
        dst = self._replica_sets[to].deployment
        with _both(src, dst):
            src_state = src.catalog.get(db, coll)
            if src_state is None:
                return
            dst_state = _ensure_copy(dst, src_state)
            for doc in list(src_state.iter_stored()):
                key = sharded.key_of(doc)
                if compare_keys(chunk.min, key) <= 0 and compare_keys(key, chunk.max) < 0:
                    src_state.remove(id_key(doc["_id"]))
                    with contextlib.suppress(Exception):
                        dst_state.insert(doc)

    def move_primary(self, db: str, to: str) -> None:
        old = self.table.primary_of(db)
        if old is None:
            raise_unknown_db(db)
        assert old is not None
        if old != to:
            src = self._replica_sets[old].deployment
            dst = self._replica_sets[to].deployment
            with _both(src, dst):
                for state in src.catalog.collections(db):
                    if self.table.sharded(state.ns) is not None:
                        continue
                    copy = _ensure_copy(dst, state)
                    for doc in list(state.iter_stored()):
                        with contextlib.suppress(Exception):
                            copy.insert(doc)
                    src.catalog.detach(db, state.name)
            with self.table.lock:
                self.table.databases[db] = to
        self.record_database(db, to)

    def mirror_collection(self, ns: str) -> None:
        """Index DDL on a sharded collection: the other shards follow the primary silently."""
        db, coll = ns.split(".", 1)
        primary = self.table.primary_of(db)
        if primary is None:
            return
        source = self._replica_sets[primary].deployment
        with source.lock:
            state = source.catalog.get(db, coll)
            specs = [dict(spec) for spec in state.indexes] if state is not None else []
        names = {spec["name"] for spec in specs}
        for rs in self.replica_sets():
            dep = rs.deployment
            if dep is source:
                continue
            with dep.lock:
                copy = dep.catalog.get(db, coll)
                if copy is None:
                    continue
                have = {spec["name"] for spec in copy.indexes}
                for spec in specs:
                    if spec["name"] not in have:
                        with contextlib.suppress(Exception):
                            copy.add_index(spec)
                for name in have - names:
                    with contextlib.suppress(Exception):
                        copy.remove_index(name)

    def forget_collection(self, ns: str, *, keep: str) -> None:
        """After the primary shard dropped a sharded collection: the others drop it silently."""
        db, coll = ns.split(".", 1)
        with self.table.lock:
            self.table.collections.pop(ns, None)
        for name, rs in self._replica_sets.items():
            if name == keep:
                continue
            with rs.deployment.lock:
                if rs.deployment.catalog.get(db, coll) is not None:
                    rs.deployment.catalog.detach(db, coll)

    def forget_database(self, db: str, *, keep: str) -> None:
        with self.table.lock:
            self.table.databases.pop(db, None)
            self.table.sharding_enabled.discard(db)
            for ns in [ns for ns in self.table.collections if ns.split(".", 1)[0] == db]:
                del self.table.collections[ns]
        for name, rs in self._replica_sets.items():
            if name == keep:
                continue
            with rs.deployment.lock:
                for coll in rs.deployment.catalog.collection_names(db):
                    rs.deployment.catalog.detach(db, coll)

    # -- updateLookup ------------------------------------------------------------------------
    def lookup(
        self, db: str, coll: str, collection_uuid: uuid.UUID | None, document_key: dict[str, Any]
    ) -> dict[str, Any] | None:
        """mongos's updateLookup: the current document, from the shard its key routes to."""
        sharded = self.table.sharded(f"{db}.{coll}")
        if sharded is None:
            name = self.table.primary_of(db)
            names = [name] if name is not None else []
        else:
            key = sharded.exact_key(document_key)
            names = [sharded.chunk_for(key).shard] if key is not None else sharded.shards()
        for name in names:
            deployment = self._replica_sets[name].deployment
            with deployment.lock:
                state = deployment.catalog.get(db, coll)
                if state is None or state.is_view:
                    continue
                if collection_uuid is not None and state.uuid != collection_uuid:
                    continue
                doc = state.find_by_id(document_key.get("_id"))
                if doc is not None:
                    return doc
        return None


def raise_unknown_host(host: str) -> None:
    from ..core.errors import CommandError

    raise CommandError(
        96, f"could not add shard {host}: no replica set of this cluster is waiting to be added"
    )


def raise_unknown_db(db: str) -> None:
    from ..core.errors import CommandError

    raise CommandError(26, f"Database {db} not found")


@contextlib.contextmanager
def _both(a: Deployment, b: Deployment) -> Iterator[None]:
    first, second = sorted((a, b), key=id)
    with first.lock, second.lock:
        yield


def _ensure_copy(deployment: Deployment, template: CollectionState) -> CollectionState:
    """The collection on another shard: same UUID, options, indexes and shard key."""
    with deployment.lock:
        state = deployment.catalog.get(template.db, template.name)
        if state is None:
            state = deployment.catalog.new_collection(
                template.db, template.name, dict(template.options)
            )
            state.uuid = template.uuid
            for spec in template.indexes[1:]:
                with contextlib.suppress(Exception):
                    state.add_index(dict(spec))
        state.shard_key = template.shard_key
        return state


# ======================================================================================
# mongos
# ======================================================================================


class RouterDispatcher(Dispatcher):
    """mongod's request path with mongos's command table."""

    def __init__(self, router: Router, deployment: Deployment, cluster: ClusterState) -> None:
        super().__init__(deployment, deployment.members[0])
        self.registry = registry_for(router)
        aliases: dict[str, set[str]] = {}
        for name, spec in self.registry.items():
            aliases.setdefault(spec.name, set()).add(name)
        self._aliases = {name: frozenset(names) for name, names in aliases.items()}
        self._cluster = cluster

    def run(self, conn: ConnectionInfo, request: Request) -> dict[str, Any]:
        reply = super().run(conn, request)
        cursor = reply.get("cursor")
        if isinstance(cursor, dict) and cursor.get("id"):
            self._cluster.track_cursor(
                self.member.name, conn.id, self.deployment.cursors, int(cursor["id"])
            )
        return reply


class MongosServer(MemberServer):
    """A mongos listener; behind a load balancer its connections are load-balanced ones."""

    def __init__(
        self, mongos: Mongos, host: str, port: int, *, load_balanced: bool = False
    ) -> None:
        super().__init__(mongos.deployment, mongos.member, host, port)
        self.dispatcher = RouterDispatcher(mongos.router, mongos.deployment, mongos.cluster)
        self._cluster = mongos.cluster
        self.load_balanced = load_balanced
        if load_balanced:  # its connections are told apart from the other listener's by id
            self.listener.connection_ids = itertools.count(LB_CONNECTION_IDS)

    def connection_made(self, conn: Connection) -> None:
        super().connection_made(conn)
        if self.load_balanced:
            self._cluster.mark_load_balanced(self.member.name, conn.id)

    def connection_lost(self, conn: Connection) -> None:
        try:
            super().connection_lost(conn)
        finally:
            self._cluster.connection_closed(self.member.name, conn.id)


class Mongos:
    """One mongos: its own cursors and failpoints, a listener, and one for the load balancer."""

    def __init__(self, cluster: ClusterState, index: int, host: str) -> None:
        self.cluster = cluster
        self.index = index
        self.host = host
        self.deployment = Deployment(
            cluster.profile,
            members=1,
            set_name=f"mongos{index}",
            clock=cluster.clock,
            users=cluster.users,
        )
        self.deployment.oplog = Oplog()  # a mongos keeps no oplog: operationTime = cluster time
        self.member = self.deployment.members[0]
        self.member.host = host
        self.service_id = ObjectId()
        self.router = Router(cluster, self.service_id)
        self.server: MongosServer | None = None
        self.lb_server: MongosServer | None = None

    @property
    def name(self) -> str:
        return self.member.name

    def start(self, port: int, *, load_balanced: bool, lb_port: int = 0) -> None:
        self.server = MongosServer(self, self.host, port)
        self.server.start()
        if load_balanced:
            self.lb_server = MongosServer(self, self.host, lb_port, load_balanced=True)
            self.lb_server.start()
            self.member.port = self.server.port  # the LB listener must not rename the mongos

    def stop(self) -> None:
        """Shut this mongos down: connections close, its cursors (and theirs on shards) die."""
        self.member.up = False
        for server in (self.lb_server, self.server):
            if server is not None:
                server.stop()
        self.deployment.cursors.kill_all()
        self.deployment.close()


# ======================================================================================
# The public entry point
# ======================================================================================


class ShardedCluster:
    """A simulated sharded cluster: ``shards`` replica sets behind ``mongoses`` mongoses.

    ``port=0`` picks free ports (the mongoses still sit on consecutive ports);
    ``noop_interval`` is every shard's ``periodicNoopIntervalSecs`` (mongod's
    default 10 s): an idle shard holds back other shards' events up to that long
    on a change stream. ``load_balancer=True`` adds a TCP front end
    (:attr:`lb_uri`) that hands each connection to a mongos in turn.
    ``users`` (``{"app": "secret"}``, users of ``admin``) turns authentication on
    on every mongos, behind the load balancer, and on the shards and config
    server (mongos itself authenticates to them, as with a keyFile).
    ``dbpath`` keeps the whole cluster in that directory (``config/`` for the
    config server, one directory per shard): :meth:`stop` writes it, the next
    ``ShardedCluster`` with the same ``dbpath`` (same version or newer) starts
    from it with the same shards, routing table, data, oplogs and cluster time.
    """

    def __init__(
        self,
        version: str = DEFAULT_VERSION,
        shards: int = 2,
        mongoses: int = 2,
        members_per_shard: int = 1,
        load_balancer: bool = False,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        noop_interval: float = 10.0,
        oplog_max_entries: int | None = None,
        users: Mapping[str, str] | None = None,
        dbpath: str | os.PathLike[str] | None = None,
    ) -> None:
        if shards < 1:
            raise ValueError(f"a sharded cluster needs at least one shard, got {shards}")
        if mongoses < 1:
            raise ValueError(f"a sharded cluster needs at least one mongos, got {mongoses}")
        if members_per_shard < 1:
            raise ValueError(f"members_per_shard must be at least 1, got {members_per_shard}")
        self.version = version
        self.profile = get_profile(version)
        self._shard_count = shards
        self._mongos_count = mongoses
        self._members = members_per_shard
        self._load_balancer = load_balancer
        self._port = port
        self._host = host
        self._noop_interval = noop_interval
        self._oplog_max_entries = oplog_max_entries
        self.clock = ClusterClock()
        self.users = Users(users)
        self.dbpath = None if dbpath is None else Path(dbpath)
        self.config = ReplicaSet(
            version, 1, set_name="configRepl", host=host, clock=self.clock, noop_interval=0,
            users=self.users, dbpath=self._dir("config"),
        )  # fmt: skip
        self.state = ClusterState(self.profile, self.clock, self.config, self.users)
        self._mongos: list[Mongos] = []
        self.balancer: LoadBalancer | None = None
        self._started = False
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> ShardedCluster:
        if self._started:
            raise RuntimeError("this ShardedCluster was already started")
        self._started = True
        try:
            self.config.start()
            restored = self.state.restored_shards()
            for info in restored:
                rs = self._shard_replica_set(info.name).start()
                self.state.add_shard(info.name, rs, restored=info)
            self.state.restore_routing()
            for _ in range(self._shard_count - len(restored)):
                self.add_shard()
            self._start_mongoses()
            if self._load_balancer:
                targets = [m.lb_server.port for m in self._mongos if m.lb_server is not None]
                self.balancer = LoadBalancer(self._host, targets)
                self.balancer.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_mongoses(self) -> None:
        for attempt in range(_PORT_ATTEMPTS):
            mongoses = [Mongos(self.state, i, self._host) for i in range(self._mongos_count)]
            # Linux hands out even ports to bind(0) and odd ones to connect(): port 0's
            # neighbour is often taken, so after one try the mongoses start below the
            # ephemeral range.
            first = self._port or (0 if attempt == 0 else random.randrange(20000, 32000))
            try:
                for i, mongos in enumerate(mongoses):
                    mongos.start(first + i if first else 0, load_balanced=self._load_balancer)
                    if i == 0:
                        assert mongos.server is not None
                        first = mongos.server.port
                self._mongos = mongoses
                return
            except OSError:
                for mongos in mongoses:
                    mongos.stop()
                if self._port:
                    raise
        raise OSError("could not find consecutive free ports for the mongoses")

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.balancer is not None:
            self.balancer.stop()
        for mongos in self._mongos:
            mongos.stop()
        failed: list[DbPathError] = []
        for rs in [*self.state.replica_sets(), *self.state.pending.values(), self.config]:
            try:
                rs.stop()
            except DbPathError as exc:  # every other member still stops
                failed.append(exc)
        if failed:
            raise failed[0]

    def __enter__(self) -> ShardedCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- shards ------------------------------------------------------------------------------
    def new_shard_replica_set(self) -> ReplicaSet:
        """Start a replica set for this cluster that ``addShard`` can then add."""
        name = f"shard{len(self.state.replica_sets()) + len(self.state.pending)}"
        rs = self._shard_replica_set(name).start()
        self.state.pending[name] = rs
        return rs

    def _shard_replica_set(self, name: str) -> ReplicaSet:
        return ReplicaSet(
            self.version,
            self._members,
            set_name=name,
            host=self._host,
            clock=self.clock,
            noop_interval=self._noop_interval,
            oplog_max_entries=self._oplog_max_entries,
            users=self.users,
            dbpath=self._dir(name),
        )

    def _dir(self, name: str) -> Path | None:
        """Where the config server or shard ``name`` keeps its data (None: in memory)."""
        return None if self.dbpath is None else self.dbpath / name

    def add_shard(self) -> str:
        """Start one more shard and add it to the cluster; return its name."""
        rs = self.new_shard_replica_set()
        return self.state.add_shard_by_host(f"{rs.deployment.set_name}/" + ",".join(rs.members))

    @property
    def shards(self) -> list[ReplicaSet]:
        """The shards' replica sets, in ``config.shards`` order."""
        return self.state.replica_sets()

    @property
    def shard_names(self) -> list[str]:
        return self.state.table.shard_names()

    # -- mongoses ----------------------------------------------------------------------------
    @property
    def mongoses(self) -> list[str]:
        """``host:port`` of every mongos that is running."""
        return [m.name for m in self._mongos if m.member.up]

    def mongos(self, index: int) -> Mongos:
        return self._mongos[index]

    def kill_mongos(self, index: int) -> None:
        """Stop mongos ``index`` (its connections drop, its cursors die)."""
        self._mongos[index].stop()

    def restart_mongos(self, index: int) -> str:
        """Start killed mongos ``index`` again on its port; return its ``host:port``.

        It comes back as a new process: no cursors, no failpoints, a new
        ``serviceId`` (behind the load balancer, on its old listener port).
        """
        old = self._mongos[index]
        if old.member.up:
            raise RuntimeError(f"mongos {index} ({old.name}) is already running")
        assert old.server is not None
        mongos = Mongos(self.state, index, self._host)
        lb_port = old.lb_server.port if old.lb_server is not None else 0
        mongos.start(old.server.port, load_balanced=self._load_balancer, lb_port=lb_port)
        self._mongos[index] = mongos
        return mongos.name

    @property
    def uri(self) -> str:
        """Every mongos, for any driver (``mongodb://h:p1,h:p2/``)."""
        if not self._mongos:
            raise RuntimeError("the ShardedCluster is not started")
        return "mongodb://" + ",".join(m.name for m in self._mongos) + "/"

    def mongos_uri(self, index: int) -> str:
        """A URI naming one mongos only."""
        return f"mongodb://{self._mongos[index].name}/"

    @property
    def lb_uri(self) -> str:
        """The load balancer's URI (``loadBalanced=true``)."""
        if self.balancer is None:
            raise RuntimeError("this ShardedCluster has no load balancer (load_balancer=True)")
        return f"mongodb://{self._host}:{self.balancer.port}/?loadBalanced=true"
