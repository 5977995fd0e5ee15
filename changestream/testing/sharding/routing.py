"""The cluster's routing table: databases' primary shards, sharded collections and chunks.

The config server holds this in ``config.databases``, ``config.collections``
and ``config.chunks``; every mongos of the simulator reads the same in-memory
table (the cluster writes the config documents too, for anyone who reads them),
so no mongos is ever stale.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import bson
from bson.max_key import MaxKey
from bson.min_key import MinKey

from ..core.errors import CommandError
from ..storage.order import compare_values
from ..storage.query import path_values


@dataclass(slots=True)
class Chunk:
    """``[min, max)`` of the shard key space (tuples of key values), owned by ``shard``."""

    min: tuple[Any, ...]
    max: tuple[Any, ...]
    shard: str


@dataclass(slots=True)
class ShardedCollection:
    """One sharded collection: its key, whether it is hashed, its UUID and chunks."""

    ns: str
    key: dict[str, Any]
    uuid: uuid.UUID
    unique: bool = False
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self.key)

    def key_of(self, doc: dict[str, Any]) -> tuple[Any, ...]:
        """The shard key value of ``doc`` (missing fields are null; hashed fields hashed)."""
        values = []
        for name, kind in self.key.items():
            found = path_values(doc, name)
            value = found[0] if found else None
            values.append(hash_value(value) if kind == "hashed" else value)
        return tuple(values)

    def exact_key(self, query: dict[str, Any]) -> tuple[Any, ...] | None:
        """The shard key a query pins with equalities on every key field, else None."""
        values = []
        for name, kind in self.key.items():
            if name not in query:
                return None
            value = query[name]
            if isinstance(value, dict):
                if set(value) != {"$eq"}:
                    return None
                value = value["$eq"]
            if isinstance(value, (list, bson.Regex)):
                return None
            values.append(hash_value(value) if kind == "hashed" else value)
        return tuple(values)

    def chunk_for(self, key: tuple[Any, ...]) -> Chunk:
        for chunk in self.chunks:
            if compare_keys(chunk.min, key) <= 0 and compare_keys(key, chunk.max) < 0:
                return chunk
        return self.chunks[-1]

    def shards(self) -> list[str]:
        """The shards owning at least one chunk, in chunk order."""
        seen: list[str] = []
        for chunk in self.chunks:
            if chunk.shard not in seen:
                seen.append(chunk.shard)
        return seen


def compare_keys(a: tuple[Any, ...], b: tuple[Any, ...]) -> int:
    for x, y in zip(a, b, strict=True):
        order = compare_values(x, y)
        if order:
            return order
    return 0


def hash_value(value: Any) -> int:
    """A 64-bit hash of one value, standing in for mongod's ``BSONElementHasher``."""
    digest = hashlib.md5(bson.encode({"": value})).digest()
    return int(struct.unpack("<q", digest[:8])[0])


def key_document(coll: ShardedCollection, values: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(coll.fields, values, strict=True))


def parse_key_document(coll: ShardedCollection, doc: Any, what: str) -> tuple[Any, ...]:
    """A ``{field: value}`` split point / find document as a key tuple (hashed as needed)."""
    if not isinstance(doc, dict) or list(doc) != list(coll.fields):
        raise CommandError(
            2, f"'{what}' must be a document with exactly the shard key fields {list(coll.key)}"
        )
    if what == "find":
        return coll.key_of(doc)
    return tuple(doc.values())


@dataclass(slots=True)
class ShardInfo:
    """One shard as ``config.shards`` lists it."""

    name: str
    added_at: Any
    """The cluster time of its ``addShard``; mongos opens its change-stream cursor after it."""


@dataclass(frozen=True, slots=True)
class PlacementChange:
    """A change of where a namespace's data lives, as the config server's placement history
    records it: what a v2 change stream's shard targeter reacts to (a control event)."""

    at: Any
    """Its cluster time: data on a newly targeted shard is read from here."""
    kind: str
    """``moveChunk``, ``movePrimary``, ``namespacePlacementChanged`` or ``databaseCreated``
    (the control events of ``change_stream_shard_targeter_metrics.cpp``)."""
    db: str
    coll: str | None = None


class RoutingTable:
    """What every mongos routes by (thread-safe: one lock for the whole table)."""

    def __init__(self, clock: Any = None) -> None:
        self.clock = clock
        """The cluster clock (ticks each placement change); None in unit tests."""
        self.placement: list[PlacementChange] = []
        """Every placement change since start, in cluster-time order (under ``lock``)."""
        self.lock = threading.RLock()
        self.shards: list[ShardInfo] = []
        self.databases: dict[str, str] = {}
        """Database -> primary shard."""
        self.collections: dict[str, ShardedCollection] = {}
        self.sharding_enabled: set[str] = set()
        """Databases ``enableSharding`` was run on (required before 6.0)."""
        self.version = 0
        """Bumped on every change of the shard list (mongos's new-shard monitor)."""

    def shard_names(self) -> list[str]:
        with self.lock:
            return [s.name for s in self.shards]

    def note_placement(self, kind: str, db: str, coll: str | None = None) -> None:
        """Record a placement change; call with ``lock`` held, with the change itself, so a
        reader holding the lock sees both or neither (and writes after it get later times)."""
        if self.clock is not None:
            self.placement.append(PlacementChange(self.clock.tick(), kind, db, coll))

    def data_shards(self, db: str, coll: str | None) -> set[str]:
        """Shards that can hold data of ``db.coll`` (``coll`` None: of any collection of
        ``db``): its chunks' shards, or the database's primary shard (none: no database)."""
        with self.lock:
            primary = self.databases.get(db)
            if primary is None:
                return set()
            if coll is not None:
                sharded = self.collections.get(f"{db}.{coll}")
                return {primary} if sharded is None else set(sharded.shards())
            found = {primary}
            for ns, sharded in self.collections.items():
                if ns.split(".", 1)[0] == db:
                    found.update(sharded.shards())
            return found

    def sharded(self, ns: str) -> ShardedCollection | None:
        with self.lock:
            return self.collections.get(ns)

    def primary_of(self, db: str, *, create: bool = False) -> str | None:
        """The database's primary shard; ``create``: pick the shard with fewest databases."""
        with self.lock:
            primary = self.databases.get(db)
            if primary is None and create and self.shards:
                counts = {s.name: 0 for s in self.shards}
                for shard in self.databases.values():
                    if shard in counts:
                        counts[shard] += 1
                primary = min(counts, key=lambda name: (counts[name], name))
                self.databases[db] = primary
                self.note_placement("databaseCreated", db)
            return primary

    def initial_chunks(self, key: dict[str, Any], primary: str) -> list[Chunk]:
        """One chunk on the primary for a range key; a hashed key's space spread over
        every shard, two chunks each (mongod's default ``numInitialChunks``)."""
        lows: tuple[Any, ...] = tuple(MinKey() for _ in key)
        highs: tuple[Any, ...] = tuple(MaxKey() for _ in key)
        hashed = next((i for i, kind in enumerate(key.values()) if kind == "hashed"), None)
        names = self.shard_names()
        if hashed is None or len(names) < 2:
            return [Chunk(lows, highs, primary)]
        count = 2 * len(names)
        span = 2**64 // count
        bounds = [-(2**63) + span * i for i in range(1, count)]
        chunks = []
        low = lows
        for i, bound in enumerate([*bounds, None]):
            high: tuple[Any, ...]
            if bound is None:
                high = highs
            else:
                high = tuple(bound if j == hashed else MinKey() for j in range(len(key)))
            chunks.append(Chunk(low, high, names[i * len(names) // count]))
            low = high
        return chunks
