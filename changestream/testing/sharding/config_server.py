"""The config server's state: what every mongos of one cluster reads from it (the shards,
the databases, the routing table, ``config.*``) and the migrations the cluster performs
(sharding a collection, chunk moves, primary moves, refining or resharding a key).

Kept apart from the servers (:mod:`.mongos`) and their lifecycle (:mod:`.cluster`): this
module only holds and changes the cluster's metadata, it listens on nothing.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bson.binary import Binary
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from ..core.auth import Users
from ..core.clock import ClusterClock
from ..core.cursors import CursorManager
from ..core.errors import CommandError
from ..core.versions import VersionProfile, fcv_tuple
from ..replset import ReplicaSet
from ..storage.catalog import CollectionState
from ..storage.deployment import Deployment
from ..storage.order import id_key
from .routing import Chunk, RoutingTable, ShardedCollection, ShardInfo, compare_keys
from .shards import Shard

if TYPE_CHECKING:
    from .router import Router


@dataclass(frozen=True, slots=True)
class RemovedShard:
    """A shard ``removeShard`` removed, and what it held when draining started."""

    name: str
    at: Timestamp
    dbs: frozenset[str]
    namespaces: frozenset[str]

    def held(self, db: str, coll: str | None) -> bool:
        """Could it have held data a stream on ``db.coll`` (``coll`` None: on ``db``) sees?"""
        if db == "admin":
            return True  # a cluster-wide stream
        if db in self.dbs:
            return True
        if coll is None:
            return any(ns.split(".", 1)[0] == db for ns in self.namespaces)
        return f"{db}.{coll}" in self.namespaces


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
        self.table = RoutingTable(clock)
        self.ddl_lock = threading.RLock()
        self.draining: dict[str, tuple[set[str], set[str]]] = {}
        """Shards ``removeShard`` is draining: the databases and collections they held."""
        self.removed: list[RemovedShard] = []
        self.retired: dict[str, ReplicaSet] = {}
        """Removed shards' replica sets: still running until the user (or :meth:`stop`)
        stops them, as a removed shard's mongod keeps running."""
        self._replica_sets: dict[str, ReplicaSet] = {}
        self.pending: dict[str, ReplicaSet] = {}
        """Replica sets started for the cluster but not added yet (``addShard`` takes them)."""
        self._config_shard = Shard("config", config)
        self._lock = threading.Lock()
        self._lb_connections: set[tuple[str, int]] = set()
        """(mongos, connectionId) of the connections that came through the load balancer."""
        self._conn_cursors: dict[tuple[str, int], list[tuple[CursorManager, int]]] = {}

    @property
    def fcv(self) -> str:
        """The cluster's ``featureCompatibilityVersion`` (the config server's)."""
        return self.config.deployment.fcv

    @property
    def placement_since(self) -> Timestamp | None:
        """Since when the config server records placement history (FCV 9.0+; None: not
        recorded, so mongos reads v1)."""
        return self.config.deployment.placement_since

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
            rs.deployment.fcv = self.fcv  # addShard sets the new shard's FCV to the cluster's
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
        docs = []
        for info in infos:
            doc = {
                "_id": info.name,
                "host": f"{info.name}/" + ",".join(self._replica_sets[info.name].members),
                "state": 1,
                "topologyTime": info.added_at,
            }
            if info.name in self.draining:
                doc["draining"] = True
            docs.append(doc)
        return docs

    # -- removeShard ---------------------------------------------------------------------------
    def remove_shard(self, name: str) -> dict[str, Any]:
        """One ``removeShard`` call (``ShardingCatalogManager::removeShard``): the first starts
        draining (the simulator's balancer moves the chunks at once), later ones report what
        is left (databases to ``movePrimary``) until the shard is gone."""
        with self.ddl_lock:
            names = self.table.shard_names()
            if name not in names:
                raise CommandError(70, f"Shard {name} does not exist")
            if not [n for n in names if n != name and n not in self.draining]:
                raise CommandError(
                    20, "Operation not allowed because it would remove the last shard"
                )
            if name not in self.draining:
                with self.table.lock:
                    dbs = {db for db, primary in self.table.databases.items() if primary == name}
                    held = {ns for ns, c in self.table.collections.items() if name in c.shards()}
                self.draining[name] = (dbs, held)
                self._drain_chunks(name, [n for n in names if n != name and n not in self.draining])
                return {"msg": "draining started successfully", "state": "started",
                        "shard": name, **self._dbs_to_move(name)}  # fmt: skip
            with self.table.lock:
                chunks = sum(
                    1 for c in self.table.collections.values() for k in c.chunks if k.shard == name
                )
                dbs_left = sum(1 for primary in self.table.databases.values() if primary == name)
            if chunks or dbs_left:
                return {"msg": "draining ongoing", "state": "ongoing",
                        "remaining": {"chunks": Int64(chunks), "dbs": Int64(dbs_left),
                                      "jumboChunks": Int64(0)},
                        **self._dbs_to_move(name)}  # fmt: skip
            dbs, held = self.draining.pop(name)
            with self.table.lock:
                self.table.shards = [s for s in self.table.shards if s.name != name]
                self.table.version += 1
                at = self.clock.tick()
                self.removed.append(RemovedShard(name, at, frozenset(dbs), frozenset(held)))
            self.retired[name] = self._replica_sets.pop(name)
            self._config_shard.command(
                "config", {"delete": "shards", "deletes": [{"q": {"_id": name}, "limit": 1}]}
            )
            return {"msg": "removeshard completed successfully", "state": "completed",
                    "shard": name}  # fmt: skip

    def _dbs_to_move(self, name: str) -> dict[str, Any]:
        """What is left on a draining shard. 8.0+ (``appendDBAndCollDrainingInfo``): the note
        only when something is left, ``dbsToMove`` always, ``collectionsToMove`` (the
        unsharded collections of the databases it is primary of); before, the older note."""
        with self.table.lock:
            dbs = sorted(db for db, primary in self.table.databases.items() if primary == name)
        if self.profile.major_minor < (8, 0):
            return {"note": "you need to drop or movePrimary these databases", "dbsToMove": dbs}
        deployment = self._replica_sets[name].deployment
        with deployment.lock:
            colls = sorted(
                state.ns
                for db in dbs
                for state in deployment.catalog.collections(db)
                if not state.is_view
                and not state.name.startswith("system.")
                and self.table.sharded(state.ns) is None
            )
        reply: dict[str, Any] = {}
        if dbs or colls:
            reply["note"] = (
                "you need to call moveCollection for collectionsToMove and afterwards "
                "movePrimary for the dbsToMove"
            )
        return {**reply, "dbsToMove": dbs, "collectionsToMove": colls}

    def _drain_chunks(self, name: str, others: list[str]) -> None:
        with self.table.lock:
            moves = [
                (sharded, chunk)
                for sharded in self.table.collections.values()
                for chunk in sharded.chunks
                if chunk.shard == name
            ]
        for i, (sharded, chunk) in enumerate(moves):
            self.move_chunk(sharded, chunk, others[i % len(others)])

    def removed_since(self, at: Timestamp) -> list[RemovedShard]:
        """Shards removed after ``at`` (``anyShardRemovedSince``)."""
        with self.table.lock:
            return [r for r in self.removed if (r.at.time, r.at.inc) > (at.time, at.inc)]

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

    def shard_holdings(self, shard: str) -> tuple[list[str], list[str]]:
        """The databases ``shard`` is primary of and the sharded collections it has chunks
        of, as the config server's documents say (before the routing table is rebuilt)."""
        primaries = sorted(
            str(doc["_id"]) for doc in self._config_docs("databases") if doc.get("primary") == shard
        )
        held = {c["uuid"] for c in self._config_docs("chunks") if c.get("shard") == shard}
        chunked = sorted(
            str(doc["_id"]) for doc in self._config_docs("collections") if doc["uuid"] in held
        )
        return primaries, chunked

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
                "u": {"_id": sharded.ns, "uuid": _binary(sharded.uuid), "key": sharded.key,
                      "unique": sharded.unique},
                "upsert": True,
            }]},
        )  # fmt: skip
        self.record_chunks(sharded)

    def record_chunks(self, sharded: ShardedCollection) -> None:
        fields = sharded.fields
        docs = [
            {"_id": ObjectId(), "uuid": _binary(sharded.uuid),
             "min": dict(zip(fields, c.min, strict=True)),
             "max": dict(zip(fields, c.max, strict=True)), "shard": c.shard}
            for c in sharded.chunks
        ]  # fmt: skip
        self._config_shard.command(
            "config", {"delete": "chunks", "deletes": [{"q": {"uuid": _binary(sharded.uuid)}, "limit": 0}]}
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
            if len(sharded.shards()) > 1:
                self.table.note_placement("namespacePlacementChanged", db, coll)
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
            with self.table.lock:
                sharded.chunks = self.table.initial_chunks(key, primary_name)
                self.table.note_placement("namespacePlacementChanged", db, coll)
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
        db, coll = sharded.ns.split(".", 1)
        with self.table.lock:
            chunk.shard = to
            self.table.note_placement("moveChunk", db, coll)
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
            _moved_at(self.clock.tick(), src, dst)

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
                _moved_at(self.clock.tick(), src, dst)
            with self.table.lock:
                self.table.databases[db] = to
                self.table.note_placement("movePrimary", db)
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


def set_cluster_fcv(cluster: ClusterState, version: str) -> None:
    """The cluster's FCV: every shard's and the config server's; placement history is kept
    from FCV 9.0 (``docs/change_streams.md``, "FCV compatibility and fallback")."""
    for rs in [*cluster.replica_sets(), cluster.config]:
        rs.deployment.fcv = version
    config = cluster.config.deployment
    recorded = cluster.profile.precise_shard_targeting and fcv_tuple(version) >= (9, 0)
    if not recorded:
        config.placement_since = None
    elif config.placement_since is None:
        config.placement_since = cluster.clock.tick()


def raise_unknown_host(host: str) -> None:
    raise CommandError(
        96, f"could not add shard {host}: no replica set of this cluster is waiting to be added"
    )


def raise_unknown_db(db: str) -> None:
    raise CommandError(26, f"Database {db} not found")


@contextlib.contextmanager
def _both(a: Deployment, b: Deployment) -> Iterator[None]:
    first, second = sorted((a, b), key=id)
    with first.lock, second.lock:
        yield


def _moved_at(at: Timestamp, *deployments: Deployment) -> None:
    """Documents moved between ``deployments`` (their locks held) are where they went from
    ``at`` on, for snapshot reads: one time for all, so a read never sees a document on
    both shards or on neither."""
    for deployment in deployments:
        deployment.mark_unlogged_writes(at)


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


def _binary(value: uuid.UUID) -> Binary:
    """A collection UUID as the config server stores it (BSON binary subtype 4), so a query
    from a client (which sends that) matches it."""
    return Binary.from_uuid(value)
