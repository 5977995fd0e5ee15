"""Gossiped ``$clusterTime`` is trusted only as mongod trusts it (issue 22, deliverable 1).

mongod (``src/mongo/db/vector_clock.cpp``, ``_ensurePassesRateLimiter`` and the cluster-time
formatter's ``in``): a time more than ``maxAcceptableLogicalClockDriftSecs`` (default one
year) ahead of the wall clock fails the command with ClusterTimeFailsRateLimiter (205); one
whose seconds or increment exceed the largest signed 32-bit value fails with 40484; with
authentication on, an unauthenticated client's unsigned time is ignored (not gossiped in) and
any other time must carry a valid HMAC proof (``logical_time_validator.cpp``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bson.binary import Binary
from bson.int64 import Int64
from bson.timestamp import Timestamp
from pymongo import MongoClient

from changestream.testing import ReplicaSet
from tests.support import raw_command

Client = MongoClient[dict[str, Any]]
StartRs = Callable[..., ReplicaSet]
Clients = Callable[..., Client]
TEN_YEARS = 10 * 365 * 24 * 3600


def _unsigned(ts: Timestamp) -> dict[str, Any]:
    return {"clusterTime": ts, "signature": {"hash": Binary(b"\0" * 20), "keyId": Int64(0)}}


def _ping(member: str, cluster_time: dict[str, Any]) -> dict[str, Any]:
    return raw_command(member, {"ping": 1, "$db": "admin", "$clusterTime": cluster_time})


def test_a_time_too_far_ahead_is_refused_and_changes_nothing(
    start_rs: StartRs, clients: Clients
) -> None:
    rs = start_rs("8.0", noop_interval=0)
    member = rs.members[0]
    before = rs.deployment.clock.current()
    reply = _ping(member, _unsigned(Timestamp(int(time.time()) + TEN_YEARS, 1)))
    assert (reply["ok"], reply["code"], reply["codeName"]) == (
        0.0, 205, "ClusterTimeFailsRateLimiter"
    )  # fmt: skip
    assert "is too far from this node's wall clock time" in reply["errmsg"]
    reply = _ping(member, _unsigned(Timestamp(2**32 - 1, 2**32 - 1)))
    assert reply["code"] == 205
    reply = _ping(member, _unsigned(Timestamp(int(time.time()), 2**32 - 1)))
    assert (reply["ok"], reply["code"]) == (0.0, 40484)
    assert rs.deployment.clock.current().time < before.time + 3600
    client = clients(rs.uri)
    client.db.c.insert_one({"_id": 1})  # writes still work
    assert client.db.c.find_one() == {"_id": 1}


def test_a_time_within_the_bound_is_taken(start_rs: StartRs) -> None:
    rs = start_rs("8.0", noop_interval=0)
    ahead = Timestamp(int(time.time()) + 3600, 7)
    assert _ping(rs.members[0], _unsigned(ahead))["ok"] == 1.0
    assert rs.deployment.clock.current() >= ahead


def test_with_auth_unauthenticated_unsigned_gossip_is_ignored(start_rs: StartRs) -> None:
    rs = start_rs("8.0", users={"app": "secret"}, noop_interval=0)
    before = rs.deployment.clock.current()
    reply = _ping(rs.members[0], _unsigned(Timestamp(int(time.time()) + TEN_YEARS, 1)))
    assert reply["ok"] == 1.0
    assert rs.deployment.clock.current().time < before.time + 3600
    signature = reply["$clusterTime"]["signature"]
    assert bytes(signature["hash"]) != b"\0" * 20 and signature["keyId"] != 0


def test_with_auth_a_forged_signature_is_refused(start_rs: StartRs) -> None:
    rs = start_rs("8.0", users={"app": "secret"}, noop_interval=0)
    member = rs.members[0]
    real = _ping(member, _unsigned(Timestamp(1, 1)))["$clusterTime"]
    ahead = Timestamp(real["clusterTime"].time + 60, 1)
    forged = {"clusterTime": ahead, "signature": real["signature"]}
    reply = _ping(member, forged)
    assert (reply["ok"], reply["code"]) == (0.0, 204)
    wrong_key = {"clusterTime": ahead, "signature": {"hash": Binary(b"x" * 20), "keyId": Int64(5)}}
    reply = _ping(member, wrong_key)
    assert (reply["ok"], reply["code"]) == (0.0, 211)
    assert _ping(member, real)["ok"] == 1.0  # the server's own signed time comes back fine


def test_with_auth_pymongo_gossips_the_signed_time_back(
    start_rs: StartRs, clients: Clients
) -> None:
    rs = start_rs("8.0", members=3, users={"app": "secret"}, noop_interval=0)
    client = clients(rs.uri, username="app", password="secret")
    with client.start_session(causal_consistency=True) as session:
        for i in range(5):
            client.db.c.insert_one({"_id": i}, session=session)
        assert client.db.c.count_documents({}, session=session) == 5
        assert session.cluster_time is not None
