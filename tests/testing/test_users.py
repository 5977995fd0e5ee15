"""User management and authentication on every entry point (issue 22, deliverable 1).

mongod's user commands (``user_management_commands.cpp``): ``createUser`` of an existing
user fails with 51003, ``dropUser``/``updateUser``/``grantRolesToUser`` of a missing one
with UserNotFound (11), an unknown role with RoleNotFound (31); ``usersInfo`` never shows
credentials. A sharded cluster with users requires SCRAM on every mongos and through the
load balancer, as mongos with ``--keyFile`` and users does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from changestream.testing import ReplicaSet, ShardedCluster

Client = MongoClient[dict[str, Any]]
StartRs = Callable[..., ReplicaSet]
Clients = Callable[..., Client]


def _code(call: Callable[[], Any]) -> int | None:
    with pytest.raises(OperationFailure) as exc:
        call()
    return exc.value.code


def test_user_commands_as_a_drivers_harness_uses_them(start_rs: StartRs, clients: Clients) -> None:
    rs = start_rs("8.0", users={"admin": "adminpw"}, noop_interval=0)
    root = clients(rs.uri, username="admin", password="adminpw")
    info = root.admin.command("usersInfo", "admin")["users"]
    assert [(u["user"], u["db"], u["roles"]) for u in info] == [
        ("admin", "admin", [{"role": "root", "db": "admin"}])
    ]
    assert "credentials" not in info[0] and info[0]["mechanisms"] == [
        "SCRAM-SHA-1", "SCRAM-SHA-256"
    ]  # fmt: skip
    root.admin.command("createUser", "reader", pwd="readerpw", roles=["read"])
    root.pymongo_test.command(
        "createUser", "local-user", pwd="pw", roles=[{"role": "readWrite", "db": "pymongo_test"}],
        mechanisms=["SCRAM-SHA-256"],
    )  # fmt: skip
    assert _code(lambda: root.admin.command("createUser", "reader", pwd="x", roles=[])) == 51003
    assert _code(lambda: root.admin.command("createUser", "x", pwd="x", roles=["nope"])) == 31
    assert _code(lambda: root.admin.command("dropUser", "ghost")) == 11
    root.admin.command("grantRolesToUser", "reader", roles=["readWrite"])
    listed = root.admin.command("usersInfo", {"user": "reader", "db": "admin"})["users"]
    assert listed[0]["roles"] == [
        {"role": "read", "db": "admin"},
        {"role": "readWrite", "db": "admin"},
    ]
    everyone = root.admin.command("usersInfo", 1, forAllDBs=True)["users"]
    assert sorted(u["_id"] for u in everyone) == [
        "admin.admin", "admin.reader", "pymongo_test.local-user"
    ]  # fmt: skip

    reader = clients(rs.uri, username="reader", password="readerpw")
    assert reader.db.c.count_documents({}) == 0
    local = clients(rs.uri, username="local-user", password="pw", authSource="pymongo_test")
    local.pymongo_test.c.insert_one({"_id": 1})

    root.admin.command("updateUser", "reader", pwd="newpw")
    with pytest.raises(OperationFailure) as exc:
        clients(rs.uri, username="reader", password="readerpw").db.c.find_one()
    assert exc.value.code == 18
    assert clients(rs.uri, username="reader", password="newpw").db.c.find_one() is None
    root.admin.command("dropUser", "reader")
    assert root.admin.command("usersInfo", "reader")["users"] == []


def test_created_users_do_not_turn_authentication_on(start_rs: StartRs, clients: Clients) -> None:
    rs = start_rs("8.0", noop_interval=0)
    client = clients(rs.uri)
    client.admin.command("createUser", "app", pwd="pw", roles=["root"])
    client.db.c.insert_one({"_id": 1})  # still no --auth, as on mongod
    authed = clients(rs.uri, username="app", password="pw")
    assert authed.db.c.find_one() == {"_id": 1}


@pytest.fixture(scope="module")
def secured_cluster() -> Iterator[ShardedCluster]:
    with ShardedCluster(
        "8.0", shards=2, mongoses=2, load_balancer=True, users={"app": "secret"}, noop_interval=1
    ) as cluster:
        yield cluster


@pytest.mark.parametrize("entry", ["mongos", "load balancer"])
def test_a_sharded_cluster_with_users_requires_authentication(
    secured_cluster: ShardedCluster, entry: str
) -> None:
    uri = secured_cluster.uri if entry == "mongos" else secured_cluster.lb_uri
    with MongoClient(uri, serverSelectionTimeoutMS=5000) as anonymous:
        assert anonymous.admin.command("ping")["ok"] == 1.0
        for call in (
            lambda: anonymous.db.c.insert_one({"x": 1}),
            lambda: anonymous.db.c.find_one(),
            lambda: anonymous.admin.command("listShards"),
            lambda: anonymous.admin.command("usersInfo", 1),
        ):
            assert _code(call) == 13
    with MongoClient(uri, username="app", password="secret", serverSelectionTimeoutMS=5000) as c:
        coll = c.db[f"c_{entry.replace(' ', '_')}"]
        with coll.watch() as stream:
            coll.insert_one({"_id": 1})
            assert next(stream)["documentKey"] == {"_id": 1}
        assert c.admin.command("usersInfo", "app")["users"][0]["user"] == "app"


def test_the_shards_of_a_secured_cluster_require_authentication_too(
    secured_cluster: ShardedCluster,
) -> None:
    shard = secured_cluster.shards[0]
    with MongoClient(shard.uri, serverSelectionTimeoutMS=5000) as anonymous:
        assert _code(lambda: anonymous.db.c.find_one()) == 13


def test_users_created_through_one_mongos_log_in_through_another(
    secured_cluster: ShardedCluster,
) -> None:
    first, second = (secured_cluster.mongos_uri(i) for i in (0, 1))
    with MongoClient(first, username="app", password="secret") as admin:
        admin.admin.command("createUser", "other", pwd="otherpw", roles=["readWrite"])
    try:
        with MongoClient(second, username="other", password="otherpw") as other:
            other.db.users_test.insert_one({"_id": 1})
    finally:
        with MongoClient(first, username="app", password="secret") as admin:
            admin.admin.command("dropUser", "other")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sharded", "--oplog-mb", "5"], "--oplog-mb is not supported with --sharded"),
        (["--sharded", "--standalone"], "--standalone is not supported with --sharded"),
        (["--sharded", "--set-name", "x"], "--set-name is not supported with --sharded"),
        (["--shards", "3"], "--shards needs --sharded"),
        (["--load-balancer"], "--load-balancer needs --sharded"),
    ],
)
def test_serve_refuses_options_it_cannot_honour(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from changestream.testing.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", "0", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
