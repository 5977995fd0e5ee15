"""mongos's sharding commands: ``shardCollection``, ``split``, ``moveChunk``, ``addShard``, ...

Each changes the routing table (under the cluster's DDL lock) and records it
in the config server's collections, as the config server does.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ...commands.admin import get_parameter as mongod_get_parameter
from ...commands.fcv import requested_fcv
from ...core.context import CommandContext
from ...core.errors import CommandError, ErrmsgError
from ..config_server import set_cluster_fcv
from ..routing import (
    Chunk,
    ShardedCollection,
    compare_keys,
    key_document,
    parse_key_document,
)
from .spec import router_command

if TYPE_CHECKING:
    from ..router import Router


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
        else:
            router.primary_shard(db, create=True)
        router.table.sharding_enabled.add(db)
        router.cluster.record_database(db, router.table.databases[db], partitioned=True)
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


def _split_field(ctx: CommandContext, name: str, kind: type) -> Any:
    """``find``/``middle`` (a document) or ``bounds`` (an array); empty when absent
    (``FieldParser::extract``: a wrong type fails the command)."""
    value = ctx.body.get(name)
    if value is None:
        return kind()
    if not isinstance(value, kind):
        expected = "object" if kind is dict else "array"
        raise ErrmsgError(f"wrong type for '{name}' field, expected {expected}, found {value!r}")
    return value


def _is_shard_key(sharded: ShardedCollection, doc: Any) -> bool:
    return isinstance(doc, dict) and list(doc) == list(sharded.fields)


def _median(router: Router, sharded: ShardedCollection, chunk: Chunk) -> tuple[Any, ...]:
    """The shard's ``splitVector`` with ``force``: the key of the chunk's middle document in
    key order (CannotSplit, 106, when the chunk holds a single key value or nothing)."""
    db, coll = sharded.ns.split(".", 1)
    deployment = router.shard(chunk.shard).deployment
    with deployment.lock:
        state = deployment.catalog.get(db, coll)
        docs = [] if state is None else list(state.iter_stored())
    keys = sorted((key for key in map(sharded.key_of, docs)
                   if compare_keys(chunk.min, key) <= 0 and compare_keys(key, chunk.max) < 0),
                  key=functools.cmp_to_key(compare_keys))
    for key in keys[len(keys) // 2:]:
        if compare_keys(key, keys[0]) != 0:  # never the range's first key (split_vector.cpp)
            return key
    raise CommandError(106, "Unable to find median in chunk because chunk is indivisible.")


def _range(sharded: ShardedCollection, chunk: Chunk) -> str:
    return f"[{key_document(sharded, chunk.min)},{key_document(sharded, chunk.max)})"


@router_command("split", admin_only=True, locks=False)
def split(router: Router, ctx: CommandContext) -> dict[str, Any]:
    """mongos's ``split`` (``cluster_split_cmd.cpp``): the chunk holding ``middle`` splits
    there; the chunk holding ``find``, or bounded by ``bounds``, at its median (the shard's
    ``splitVector`` with ``force``). Its own checks fail as ``{ok: 0, errmsg}`` without a code
    (an ``ErrmsgCommandDeprecated``); ``config.chunks`` then lists both halves."""
    db, coll = _ns_arg(ctx)
    with router.cluster.ddl_lock:
        sharded = router.table.sharded(f"{db}.{coll}")
        if sharded is None:
            raise CommandError(118, f"ns {db}.{coll} is not sharded")
        find = _split_field(ctx, "find", dict)
        bounds = _split_field(ctx, "bounds", list)
        middle = _split_field(ctx, "middle", dict)
        if bounds and len(bounds) < 2:
            raise ErrmsgError("upper bound not specified")
        problem = (
            "cannot specify bounds and find at the same time" if find and bounds
            else "need to specify find/bounds or middle" if not (find or bounds or middle)
            else "cannot specify find and middle together" if find and middle
            else "cannot specify bounds and middle together" if bounds and middle
            else None
        )  # fmt: skip
        if problem is not None:
            raise ErrmsgError(problem)
        point: tuple[Any, ...] | None = None
        if find:
            key = sharded.exact_key(find)
            if key is None:
                raise ErrmsgError(f"no shard key found in chunk query {find}")
            chunk = sharded.chunk_for(key)
        elif bounds:
            if not (_is_shard_key(sharded, bounds[0]) and _is_shard_key(sharded, bounds[1])):
                raise ErrmsgError(
                    f"shard key bounds [{bounds[0]},{bounds[1]}) are not valid for shard key "
                    f"pattern {sharded.key}")
            low, high = tuple(bounds[0].values()), tuple(bounds[1].values())
            chunk = sharded.chunk_for(low)
            if compare_keys(chunk.min, low) != 0 or compare_keys(chunk.max, high) != 0:
                raise ErrmsgError(f"no chunk found with the shard key bounds [{bounds[0]}, "
                                  f"{bounds[1]})")
        else:
            if not _is_shard_key(sharded, middle):
                raise ErrmsgError(f"new split key {middle} is not valid for shard key pattern "
                                  f"{sharded.key}")
            point = tuple(middle.values())
            chunk = sharded.chunk_for(point)
            if compare_keys(chunk.min, point) == 0 or compare_keys(chunk.max, point) == 0:
                raise ErrmsgError(f"new split key {middle} is a boundary key of existing chunk "
                                  f"{_range(sharded, chunk)}")
        if point is None:
            point = _median(router, sharded, chunk)
        with router.table.lock:
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


@router_command("removeShard", "removeshard", admin_only=True, locks=False)
def remove_shard(router: Router, ctx: CommandContext) -> dict[str, Any]:
    name = ctx.target
    if not isinstance(name, str):
        raise CommandError(2, "removeShard needs a shard name")
    return router.cluster.remove_shard(name)


@router_command("getParameter", admin_only=True, locks=False, any_member=True)
def get_parameter(router: Router, ctx: CommandContext) -> dict[str, Any]:
    """mongod's ``getParameter`` on this mongos, its ``featureCompatibilityVersion`` the
    cluster's (which ``setFeatureCompatibilityVersion`` through any mongos changes)."""
    reply = mongod_get_parameter(ctx)
    if "featureCompatibilityVersion" in reply:
        reply["featureCompatibilityVersion"] = {"version": router.cluster.fcv}
    return reply


@router_command("setFeatureCompatibilityVersion", admin_only=True, locks=False)
def set_fcv(router: Router, ctx: CommandContext) -> dict[str, Any]:
    """The cluster's FCV; below 9.0 the config server stops recording placement history,
    so open v2 change streams fall back to v1 (234 on their next getMore)."""
    cluster = router.cluster
    with cluster.ddl_lock:
        version = requested_fcv(router.profile, ctx.body, cluster.fcv)
        if version is not None:
            set_cluster_fcv(cluster, version)
    return {}
