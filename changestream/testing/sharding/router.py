"""One mongos's view of the cluster: its connections to the shards and what it routes by.

Unsharded collections live on their database's primary shard; a sharded
collection's documents on the shard owning their chunk. The commands that use
it are in :mod:`.commands`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bson.objectid import ObjectId

from .routing import ShardedCollection
from .shards import Shard

if TYPE_CHECKING:
    from ..core.cs_metrics import ChangeStreamMetrics
    from .config_server import ClusterState


class Router:
    """One mongos: its connections to the shards and what it routes by."""

    def __init__(
        self, cluster: ClusterState, service_id: ObjectId, metrics: ChangeStreamMetrics
    ) -> None:
        self.cluster = cluster
        self.table = cluster.table
        self.clock = cluster.clock
        self.profile = cluster.profile
        self.service_id = service_id
        self.cluster_metrics = metrics
        """This mongos's ``serverStatus().metrics.changeStreams``."""
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
