"""What a sharded cluster's ``dbpath`` must hold before any of it starts: the config server's
data, one file per shard it lists, all from the same clean stop.

Each part alone would load (a shard without its config server is a replica set with data;
a config server without a shard's file lists an empty shard), so a missing or stale part
would start and serve part of the data. The config server knows the shards and which hold
data; every file records the cluster's generation (one more at each clean stop), so a file
from an older stop is told apart. One :class:`~.persist.DbPathError` names the part.
"""

from __future__ import annotations

from pathlib import Path

from ..storage.persist import SNAPSHOT, DbPathError, has_snapshot, snapshot_generation
from .config_server import ClusterState

CONFIG_DIR = "config"
_FRESH = "start with an empty dbpath for a new cluster"


def check_sharded_dbpath(dbpath: Path, state: ClusterState) -> None:
    """Raise :class:`DbPathError` naming the first missing or stale part of ``dbpath``
    (the config server's data is already loaded into ``state``)."""
    config_dir = dbpath / CONFIG_DIR
    shards = [info.name for info in state.restored_shards()]
    if not has_snapshot(config_dir):
        orphans = sorted(
            p.name for p in dbpath.iterdir() if p.name != CONFIG_DIR and has_snapshot(p)
        )
        if orphans:
            raise DbPathError(
                f"{config_dir / SNAPSHOT} is missing, but {dbpath} holds the data of "
                f"{', '.join(orphans)}: without the config server's data (the shard list, "
                "the databases and where each chunk lives) their documents cannot be routed; "
                f"restore {config_dir} or {_FRESH}"
            )
        return
    expected = state.config.deployment.generation
    for name in shards:
        shard_dir = dbpath / name
        if not has_snapshot(shard_dir):
            what = "directory" if not shard_dir.is_dir() else "file"
            missing = shard_dir if what == "directory" else shard_dir / SNAPSHOT
            raise DbPathError(
                f"{missing} is missing: the config server lists shard {name!r}"
                f"{_holdings(state, name)}, but its data {what} is gone; restore it or {_FRESH}"
            )
        readable, generation = snapshot_generation(shard_dir)
        if readable and generation != expected:
            raise DbPathError(
                f"{shard_dir / SNAPSHOT} is from another stop of this cluster than the config "
                f"server's data (generation {_shown(generation)}, the config server's "
                f"{_shown(expected)}): a shard file restored from an older copy would serve "
                f"old data and miss the documents written since; restore the files of one "
                f"stop together or {_FRESH}"
            )


def _holdings(state: ClusterState, shard: str) -> str:
    """`` (primary of db a; chunks of a.c)``: what the config server says the shard holds."""
    primaries, chunked = state.shard_holdings(shard)
    parts = ([f"primary of {', '.join(primaries)}"] if primaries else []) + (
        [f"chunks of {', '.join(chunked)}"] if chunked else []
    )
    return f" ({'; '.join(parts)})" if parts else ""


def _shown(generation: int | None) -> str:
    return "none" if generation is None else str(generation)
