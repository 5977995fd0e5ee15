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
The WiredTiger section is not emulated; the other sections (``latencyStats``, ``count``,
``queryExecStats``) are refused (115). Other namespaces keep the simulator's refusal.
"""

from __future__ import annotations

from typing import Any, Final

from bson.decimal128 import Decimal128
from bson.int64 import Int64

from ..core.context import CommandContext
from ..core.errors import CommandError
from ..storage import type_name

DEFAULT_MAX_SIZE: Final = 990 * 1024 * 1024
"""mongod's smallest default oplog size (990 MB) when no ``--oplogSize`` is given."""


def is_oplog_coll_stats(db: str, coll: str | None, stages: list[tuple[str, Any]]) -> bool:
    return db == "local" and coll == "oplog.rs" and bool(stages) and stages[0][0] == "$collStats"


_OTHER_STATS: Final = ("latencyStats", "count", "queryExecStats")
"""``$collStats`` sections mongod has and the simulator does not answer on the oplog."""


def _max_size(
    size: int, count: int, max_bytes: int | None, max_entries: int | None, truncated: bool
) -> int:
    """The oplog's ``maxSize``: its byte limit, else the bytes at its entry limit (its size
    once entries dropped off, an estimate from the average entry before), else mongod's
    default."""
    if max_bytes is not None:
        return max_bytes
    if max_entries is None:
        return DEFAULT_MAX_SIZE
    if truncated:
        return size
    if not count:
        return DEFAULT_MAX_SIZE
    return size * max_entries // count


def _scale(options: dict[str, Any]) -> int:
    scale = options.get("scale", 1)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, Int64, Decimal128)):
        raise CommandError(
            14,
            f"BSON field '$collStats.storageStats.scale' is the wrong type '{type_name(scale)}', "
            "expected types '[long, int, decimal, double]'",
        )
    value = float(scale.to_decimal()) if isinstance(scale, Decimal128) else scale
    if value < 1:
        raise CommandError(51024, f"BSON field 'scale' value must be >= 1, actual value '{scale}'")
    return int(value)


def oplog_coll_stats(ctx: CommandContext, spec: Any) -> list[dict[str, Any]]:
    """The one document ``$collStats`` gives for ``local.oplog.rs`` (storageStats only)."""
    deployment = ctx.deployment
    if not isinstance(spec, dict):
        raise CommandError(5447000, f"$collStats must take a nested object but found: {spec!r}")
    for name in spec:
        if name in _OTHER_STATS:
            raise CommandError(
                115, f"$collStats {name} is not supported by the simulator on local.oplog.rs"
            )
        if name != "storageStats":
            raise CommandError(40415, f"BSON field '$collStats.{name}' is an unknown field.")
    doc: dict[str, Any] = {
        "ns": "local.oplog.rs",
        "host": ctx.member.name,
        "localTime": deployment.clock.wall(),
    }
    if "storageStats" not in spec:
        return [doc]
    options = spec["storageStats"]
    if not isinstance(options, dict):
        raise CommandError(
            14,
            f"BSON field '$collStats.storageStats' is the wrong type '{type_name(options)}', "
            "expected type 'object'",
        )
    scale = _scale(options)
    if deployment.standalone:
        raise CommandError(
            26,
            "PlanExecutor error during aggregation :: caused by :: Unable to retrieve "
            "storageStats in $collStats stage :: caused by :: Collection [local.oplog.rs] "
            "not found.",
        )
    oplog = deployment.oplog
    size, count = oplog.size, len(oplog)
    max_size = _max_size(size, count, oplog.max_bytes, oplog.max_entries, oplog.truncated)
    stats: dict[str, Any] = {"size": size // scale, "count": count}
    if count:
        stats["avgObjSize"] = size // count
    stats.update(
        numOrphanDocs=0,
        storageSize=size // scale,
        freeStorageSize=0,
        capped=True,
        max=0,
        maxSize=max_size // scale,
        nindexes=0,
        indexDetails={},
        indexBuilds=[],
        totalIndexSize=0,
        indexSizes={},
        totalSize=size // scale,
        scaleFactor=scale,
    )
    doc["storageStats"] = stats
    return [doc]
