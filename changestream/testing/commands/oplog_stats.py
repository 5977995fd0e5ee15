"""``$collStats: {storageStats: {}}`` on ``local.oplog.rs``: how full the oplog is.

mongod answers it from ``appendCollectionStorageStats`` (``storage_stats.cpp``): one
document ``{ns, host, localTime, storageStats}`` whose ``storageStats`` holds, in this
order, ``size``, ``count``, ``avgObjSize`` (only when ``count``), ``numOrphanDocs``,
``storageSize``, ``freeStorageSize``, ``capped``, ``max``, ``maxSize`` (capped only),
``nindexes``, ``indexDetails``, ``indexBuilds``, ``totalIndexSize``, ``indexSizes``,
``totalSize`` and ``scaleFactor``; sizes are divided by ``scale``. The oplog is capped,
has no document limit (``max`` 0) and no indexes. Its ``maxSize`` here: the byte limit
(``--oplog-mb``); with only an entry limit, the bytes at that limit (the current size once
entries drop off); with no limit, 990 MiB (mongod's smallest default ``--oplogSize``).
The WiredTiger section is not emulated. Other namespaces keep the simulator's refusal.
"""

from __future__ import annotations

from typing import Any, Final

from ..core.context import CommandContext
from ..core.errors import CommandError

DEFAULT_MAX_SIZE: Final = 990 * 1024 * 1024
"""mongod's smallest default oplog size (990 MB) when no ``--oplogSize`` is given."""


def is_oplog_coll_stats(db: str, coll: str | None, stages: list[tuple[str, Any]]) -> bool:
    return db == "local" and coll == "oplog.rs" and bool(stages) and stages[0][0] == "$collStats"


def _max_size(size: int, count: int, max_bytes: int | None, max_entries: int | None,
              truncated: bool) -> int:
    if max_bytes is not None:
        return max_bytes
    if max_entries is not None:
        if truncated or not count:
            return size if truncated else DEFAULT_MAX_SIZE
        return size * max_entries // count
    return DEFAULT_MAX_SIZE


def oplog_coll_stats(ctx: CommandContext, spec: Any) -> list[dict[str, Any]]:
    """The one document ``$collStats`` gives for ``local.oplog.rs`` (storageStats only)."""
    deployment = ctx.deployment
    if not isinstance(spec, dict):
        raise CommandError(5447000, "$collStats must take a nested object but found: "
                           f"{spec!r}")
    doc: dict[str, Any] = {"ns": "local.oplog.rs", "host": ctx.member.name,
                           "localTime": deployment.clock.wall()}
    if "storageStats" not in spec:
        return [doc]
    options = spec["storageStats"]
    if not isinstance(options, dict):
        raise CommandError(14, "BSON field '$collStats.storageStats' is the wrong type, "
                           "expected type 'object'")
    scale = options.get("scale", 1)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 1:
        raise CommandError(51024, f"BSON field 'scale' value must be >= 1, actual value '{scale}'")
    scale = int(scale)
    if deployment.standalone:
        raise CommandError(26, "Unable to retrieve storageStats in $collStats stage :: caused "
                           "by :: Collection [local.oplog.rs] not found.")
    oplog = deployment.oplog
    size, count = oplog.size, len(oplog)
    max_size = _max_size(size, count, oplog.max_bytes, oplog.max_entries, oplog.truncated)
    stats: dict[str, Any] = {"size": size // scale, "count": count}
    if count:
        stats["avgObjSize"] = size // count
    stats.update({
        "numOrphanDocs": 0,
        "storageSize": size // scale,
        "freeStorageSize": 0,
        "capped": True,
        "max": 0,
        "maxSize": max_size // scale,
        "nindexes": 0,
        "indexDetails": {},
        "indexBuilds": [],
        "totalIndexSize": 0,
        "indexSizes": {},
        "totalSize": size // scale,
        "scaleFactor": scale,
    })
    doc["storageStats"] = stats
    return [doc]
