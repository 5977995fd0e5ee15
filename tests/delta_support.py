"""Helpers of the Delta sink tests (plain and Spark): a write mix, and the table read back."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import deltalake
from bson import json_util


def table_state(path: Path | str) -> dict[Any, Any]:
    """The table's current state as {_id: document} (read_current); a key twice is a failure."""
    from changestream.delta import DeltaSink

    rows = DeltaSink(str(path)).read_current().to_pylist()
    state = {json_util.loads(row["_key"]): json_util.loads(row["document"]) for row in rows}
    assert len(state) == len(rows), "a key has more than one row"
    return state


def plain_state(path: Path | str) -> dict[Any, Any]:
    """The table read plainly (no query): {_id: document}; a key twice or a delete row fails."""
    rows = deltalake.DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    assert all(row["_op"] == "upsert" and row["_seq"] == 0 for row in rows), "a log row is left"
    state = {json_util.loads(row["_key"]): json_util.loads(row["document"]) for row in rows}
    assert len(state) == len(rows), "a key has more than one row"
    return state


def committed_versions(path: Path | str, app_id: str) -> list[int]:
    """The batch versions of ``app_id``'s commits, oldest first."""
    history = deltalake.DeltaTable(str(path)).history()
    return [int(c["changestream.version"]) for c in reversed(history)
            if c.get("changestream.app_id") == app_id and "changestream.version" in c]


def assert_mirrors(path: Path | str, coll: Any, app_id: str) -> None:
    assert table_state(path) == {doc["_id"]: doc for doc in coll.find()}
    versions = committed_versions(path, app_id)
    assert versions == list(range(len(versions))), f"batch versions not applied once: {versions}"


def write_mix(coll: Any, ops: int, seed: int, keys: int = 40, transactions: bool = True) -> None:
    """Inserts, updates, replaces, deletes and re-inserts of few keys, and transactions
    (the simulator's mongos runs none: there a transaction's writes go one by one)."""
    rnd = random.Random(seed)
    for n in range(ops):
        key = rnd.randrange(keys)
        roll = rnd.random()
        if roll < 0.1 and not transactions:
            coll.delete_one({"_id": key})
            coll.insert_one({"_id": key, "v": n, "txn": False})
        elif roll < 0.1:
            with coll.database.client.start_session() as session, session.start_transaction():
                coll.delete_one({"_id": key}, session=session)
                coll.insert_one({"_id": key, "v": n, "txn": True}, session=session)
                coll.update_one({"_id": (key + 1) % keys}, {"$set": {"t": n}}, upsert=True,
                                session=session)
        elif roll < 0.4:
            coll.update_one({"_id": key}, {"$inc": {"c": 1}, "$set": {"n": n}}, upsert=True)
        elif roll < 0.55:
            coll.replace_one({"_id": key}, {"_id": key, "replaced": n}, upsert=True)
        elif roll < 0.75:
            coll.delete_one({"_id": key})
        else:
            coll.update_one({"_id": key}, {"$set": {"v": n}}, upsert=True)
