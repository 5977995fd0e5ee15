"""``changestream mirror`` end to end: what the table holds when it exits (``--until-idle``)
and changes over 16 MB (``--oversize``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

pytest.importorskip("deltalake", reason="the delta extra is not installed")

from delta_support import assert_mirrors

from changestream.testing import ReplicaSet


def mirror(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "changestream", "mirror", *args, "--no-status"],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("7.0") as replica_set:
        yield replica_set


@pytest.fixture
def client(rs: ReplicaSet) -> Iterator[MongoClient[dict[str, Any]]]:
    with MongoClient(rs.uri) as mongo:
        yield mongo


def test_until_idle_returns_with_a_backlog_applied(
    rs: ReplicaSet, client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    """The table is current as of the start when ``--until-idle`` exits 0: a snapshot and a
    backlog of updates made while no mirror ran are all in it, with a short idle time."""
    coll = client.db.backlog
    coll.insert_many([{"_id": i, "v": 0, "pad": "x" * 150} for i in range(3000)])
    target = str(tmp_path / "t")
    args = [rs.uri, "--db", "db", "--coll", "backlog", "--to", target]
    first = mirror(*args, "--until-idle", "0.2")
    assert first.returncode == 0, first.stderr
    assert_mirrors(target, coll, "changestream-mirror")
    for round_ in range(1, 4):  # a backlog, applied in several commits
        coll.update_many({"_id": {"$gte": round_ * 500}}, {"$inc": {"v": 1}})
    coll.delete_many({"_id": {"$lt": 100}})
    second = mirror(*args, "--until-idle", "0.2", "--batch", "500")
    assert second.returncode == 0, second.stderr
    assert_mirrors(target, coll, "changestream-mirror")


def test_oversize_split_gets_a_change_over_16_mb_into_the_table(
    rs: ReplicaSet, client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    coll = client.db.big
    coll.insert_one({"_id": 1, "a": "x" * (7 << 20)})
    target = str(tmp_path / "t")
    args = [rs.uri, "--db", "db", "--coll", "big", "--to", target, "--until-idle", "0.5"]
    assert mirror(*args).returncode == 0  # the snapshot: the document is under 16 MB
    coll.update_one({"_id": 1}, {"$set": {"b": "y" * (7 << 20)}})  # an event of about 21 MB
    coll.insert_one({"_id": 2, "small": True})
    refused = mirror(*args)
    assert refused.returncode == 1
    said = [line for line in refused.stderr.splitlines() if "larger than 16 MB" in line]
    assert len(said) == 1 and "--oversize split" in said[0], refused.stderr  # once, one line
    joined = mirror(*args, "--oversize", "split")
    assert joined.returncode == 0, joined.stderr
    assert_mirrors(target, coll, "changestream-mirror")
