"""DDL and listing commands: replies and the exact command oplog entries."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from changestream.testing.commands import REGISTRY, CommandContext, ConnectionInfo
from changestream.testing.core.errors import CommandError
from changestream.testing.core.oplog import OplogEntry
from changestream.testing.core.versions import get_profile
from changestream.testing.storage.deployment import Deployment

ID_INDEX = {"v": 2, "key": {"_id": 1}, "name": "_id_"}


def make(version: str = "8.0") -> Deployment:
    return Deployment(get_profile(version))


@pytest.fixture
def dep() -> Deployment:
    return make()


def run(dep: Deployment, body: dict[str, Any], db: str = "db") -> dict[str, Any]:
    ctx = CommandContext(
        deployment=dep,
        member=dep.members[0],
        connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db=db,
        name=next(iter(body)),
        body=body,
    )
    return REGISTRY[ctx.name].handler(ctx)


def failure(dep: Deployment, body: dict[str, Any], db: str = "db") -> CommandError:
    with pytest.raises(CommandError) as info:
        run(dep, body, db)
    return info.value


def since(dep: Deployment) -> int:
    return dep.oplog.end_seq


def entries(dep: Deployment, start: int) -> list[OplogEntry]:
    return dep.oplog.read(start)


def uuid_of(dep: Deployment, coll: str, db: str = "db") -> uuid.UUID:
    state = dep.catalog.get(db, coll)
    assert state is not None
    return state.uuid


# -- create ----------------------------------------------------------------------------------


def test_create_logs_options_in_mongod_order(dep: Deployment) -> None:
    start = since(dep)
    body = {
        "create": "c",
        "validator": {"a": {"$exists": True}},
        "changeStreamPreAndPostImages": {"enabled": True},
        "capped": True,
        "size": 4096,
        "writeConcern": {"w": 1},
        "comment": "ignored",
    }
    assert run(dep, body) == {}
    (entry,) = entries(dep, start)
    assert (entry.op, entry.ns, entry.ui) == ("c", "db.$cmd", uuid_of(dep, "c"))
    assert list(entry.o.items()) == [
        ("create", "c"),
        ("capped", True),
        ("size", 4096),
        ("changeStreamPreAndPostImages", {"enabled": True}),
        ("validator", {"a": {"$exists": True}}),
        ("idIndex", ID_INDEX),
    ]
    state = dep.catalog.get("db", "c")
    assert state is not None and state.pre_post_images


def test_create_existing_collection_depends_on_the_version() -> None:
    new, old = make("8.0"), make("6.0")
    for dep in (new, old):
        run(dep, {"create": "c"})
    start = since(new)
    assert run(new, {"create": "c"}) == {}  # 7.0+: same options, nothing to do
    assert entries(new, start) == []
    err = failure(new, {"create": "c", "capped": True, "size": 10})
    assert err.code == 48 and "already exists, but with different options" in err.errmsg
    err = failure(old, {"create": "c"})
    assert (err.code, err.errmsg) == (48, "Collection db.c already exists.")


def test_create_rejects_unknown_options(dep: Deployment) -> None:
    err = failure(dep, {"create": "c", "bogus": 1})
    assert (err.code, err.errmsg) == (40415, "BSON field 'create.bogus' is an unknown field.")
    assert (
        failure(
            make("5.0"), {"create": "c", "changeStreamPreAndPostImages": {"enabled": True}}
        ).code
        == 40415
    )


def test_create_view_logs_system_views_then_the_view(dep: Deployment) -> None:
    start = since(dep)
    run(dep, {"create": "v", "viewOn": "src", "pipeline": [{"$match": {"a": 1}}]})
    first, second = entries(dep, start)
    assert first.o == {"create": "system.views", "idIndex": ID_INDEX}
    assert first.ui == uuid_of(dep, "system.views")
    # no create command for the view: only the insert of its definition (as mongod)
    assert (second.op, second.ns, second.o, second.o2, second.ui) == (
        "i",
        "db.system.views",
        {"_id": "db.v", "viewOn": "src", "pipeline": [{"$match": {"a": 1}}]},
        {"_id": "db.v"},
        uuid_of(dep, "system.views"),
    )
    view = dep.catalog.get("db", "v")
    assert view is not None and view.is_view and view.indexes == []
    listing = run(dep, {"listCollections": 1, "nameOnly": True})["cursor"]["firstBatch"]
    assert listing == [
        {"name": "system.views", "type": "collection"},
        {"name": "v", "type": "view"},
    ]


# -- drop / dropDatabase -----------------------------------------------------------------------------


def test_drop_logs_one_entry_and_reports_the_indexes(dep: Deployment) -> None:
    run(dep, {"createIndexes": "c", "indexes": [{"key": {"a": 1}, "name": "a_1"}]})
    coll_uuid = uuid_of(dep, "c")
    start = since(dep)
    assert run(dep, {"drop": "c"}) == {"nIndexesWas": 2, "ns": "db.c"}
    assert [(e.op, e.ns, e.o, e.ui) for e in entries(dep, start)] == [
        ("c", "db.$cmd", {"drop": "c"}, coll_uuid)
    ]
    assert dep.catalog.get("db", "c") is None


def test_dropping_a_missing_collection_depends_on_the_version() -> None:
    new = make("8.0")
    start = since(new)
    assert run(new, {"drop": "nope"}) == {}
    assert entries(new, start) == []
    err = failure(make("6.0"), {"drop": "nope"})
    assert (err.code, err.errmsg) == (26, "ns not found")


def test_dropping_a_view_removes_its_system_views_document(dep: Deployment) -> None:
    run(dep, {"create": "v", "viewOn": "src"})
    start = since(dep)
    assert run(dep, {"drop": "v"}) == {"ns": "db.v"}
    assert [(e.op, e.ns, e.o, e.ui) for e in entries(dep, start)] == [
        ("d", "db.system.views", {"_id": "db.v"}, uuid_of(dep, "system.views"))
    ]


def test_drop_database_drops_each_collection_first(dep: Deployment) -> None:
    run(dep, {"insert": "a", "documents": [{}]})
    run(dep, {"insert": "b", "documents": [{}]})
    run(dep, {"create": "v", "viewOn": "a"})
    ids = {name: uuid_of(dep, name) for name in ("a", "b", "system.views")}
    start = since(dep)
    assert run(dep, {"dropDatabase": 1}) == {"dropped": "db"}
    assert [(e.ns, e.o, e.ui) for e in entries(dep, start)] == [
        ("db.$cmd", {"drop": "a"}, ids["a"]),
        ("db.$cmd", {"drop": "b"}, ids["b"]),
        ("db.$cmd", {"drop": "system.views"}, ids["system.views"]),
        ("db.$cmd", {"dropDatabase": 1}, None),
    ]
    assert dep.catalog.database_names() == []
    start = since(dep)
    assert run(dep, {"dropDatabase": 1}) == {}
    assert entries(dep, start) == []


# -- renameCollection ----------------------------------------------------------------------------------


def test_rename_with_drop_target_records_the_dropped_uuid(dep: Deployment) -> None:
    run(dep, {"insert": "src", "documents": [{"_id": 1}]})
    run(dep, {"insert": "dst", "documents": [{"_id": 2}]})
    src_uuid, dst_uuid = uuid_of(dep, "src"), uuid_of(dep, "dst")
    start = since(dep)
    body = {"renameCollection": "db.src", "to": "db.dst", "dropTarget": True}
    assert run(dep, body, db="admin") == {}
    (entry,) = entries(dep, start)  # no separate drop entry for the target
    assert (entry.op, entry.ns, entry.ui) == ("c", "db.$cmd", src_uuid)
    assert list(entry.o.items()) == [
        ("renameCollection", "db.src"),
        ("to", "db.dst"),
        ("stayTemp", False),
        ("dropTarget", dst_uuid),
    ]
    renamed = dep.catalog.get("db", "dst")
    assert renamed is not None and renamed.uuid == src_uuid
    assert list(renamed.documents()) == [{"_id": 1}]
    assert dep.catalog.get("db", "src") is None
    assert REGISTRY["renameCollection"].admin_only


def test_rename_errors(dep: Deployment) -> None:
    run(dep, {"insert": "a", "documents": [{}]})
    run(dep, {"insert": "b", "documents": [{}]})
    start = since(dep)
    assert failure(dep, {"renameCollection": "db.a", "to": "db.b"}, "admin").code == 48
    assert failure(dep, {"renameCollection": "db.x", "to": "db.y"}, "admin").code == 26
    assert failure(dep, {"renameCollection": "db.a", "to": "db.a"}, "admin").code == 20
    assert entries(dep, start) == []
    start = since(dep)
    run(dep, {"renameCollection": "db.a", "to": "db.c"}, "admin")
    assert [e.o for e in entries(dep, start)] == [
        {"renameCollection": "db.a", "to": "db.c", "stayTemp": False}
    ]


# -- indexes --------------------------------------------------------------------------------------------------


def test_create_indexes_logs_one_entry_per_index(dep: Deployment) -> None:
    start = since(dep)
    reply = run(dep, {"createIndexes": "c", "indexes": [
        {"key": {"a": 1}, "name": "a_1"},
        {"key": {"b": -1, "c": 1}, "name": "bc", "unique": True, "sparse": True},
    ]})  # fmt: skip
    assert reply == {
        "numIndexesBefore": 1,
        "numIndexesAfter": 3,
        "createdCollectionAutomatically": True,
    }
    create, first, second = entries(dep, start)
    assert create.o["create"] == "c"
    coll_uuid = uuid_of(dep, "c")
    assert [(e.ns, e.ui) for e in (first, second)] == [("db.$cmd", coll_uuid)] * 2
    assert list(first.o.items()) == [
        ("createIndexes", "c"),
        ("v", 2),
        ("key", {"a": 1}),
        ("name", "a_1"),
    ]
    assert second.o == {"createIndexes": "c", "v": 2, "key": {"b": -1, "c": 1}, "name": "bc",
                        "unique": True, "sparse": True}  # fmt: skip
    start = since(dep)
    again = run(dep, {"createIndexes": "c", "indexes": [{"key": {"a": 1}, "name": "a_1"}]})
    assert again == {
        "numIndexesBefore": 3,
        "numIndexesAfter": 3,
        "note": "all indexes already exist",
    }
    assert entries(dep, start) == []


def test_create_indexes_conflicts(dep: Deployment) -> None:
    run(dep, {"createIndexes": "c", "indexes": [{"key": {"a": 1}, "name": "a_1"}]})
    assert (
        failure(dep, {"createIndexes": "c", "indexes": [{"key": {"b": 1}, "name": "a_1"}]}).code
        == 86
    )
    assert (
        failure(dep, {"createIndexes": "c", "indexes": [{"key": {"a": 1}, "name": "other"}]}).code
        == 85
    )
    same_name_new_options = {"key": {"a": 1}, "name": "a_1", "unique": True}
    assert failure(dep, {"createIndexes": "c", "indexes": [same_name_new_options]}).code == 85
    assert (
        failure(dep, {"createIndexes": "c", "indexes": [{"key": {"a": "nope"}, "name": "x"}]}).code
        == 67
    )
    run(dep, {"insert": "c", "documents": [{"u": 1}, {"u": 1}]})
    err = failure(
        dep, {"createIndexes": "c", "indexes": [{"key": {"u": 1}, "name": "u_1", "unique": True}]}
    )
    assert err.code == 11000 and err.extra == {"keyPattern": {"u": 1}, "keyValue": {"u": 1}}


def test_drop_indexes_logs_the_dropped_specs(dep: Deployment) -> None:
    run(dep, {"createIndexes": "c", "indexes": [
        {"key": {"a": 1}, "name": "a_1", "hidden": True},
        {"key": {"b": 1}, "name": "b_1"},
    ]})  # fmt: skip
    coll_uuid = uuid_of(dep, "c")
    start = since(dep)
    assert run(dep, {"dropIndexes": "c", "index": {"a": 1}}) == {"nIndexesWas": 3}
    assert run(dep, {"dropIndexes": "c", "index": "*"}) == {"nIndexesWas": 2}
    assert [(e.o, e.o2, e.ui) for e in entries(dep, start)] == [
        ({"dropIndexes": "c", "index": "a_1"}, {"v": 2, "key": {"a": 1}, "name": "a_1", "hidden": True}, coll_uuid),
        ({"dropIndexes": "c", "index": "b_1"}, {"v": 2, "key": {"b": 1}, "name": "b_1"}, coll_uuid),
    ]  # fmt: skip
    assert failure(dep, {"dropIndexes": "c", "index": "zz"}).code == 27
    assert failure(dep, {"dropIndexes": "c", "index": "_id_"}).code == 72
    assert failure(dep, {"dropIndexes": "nope", "index": "*"}).code == 26
    assert run(dep, {"listIndexes": "c"})["cursor"] == {
        "firstBatch": [ID_INDEX],
        "id": 0,
        "ns": "db.$cmd.listIndexes.c",
    }


# -- collMod ---------------------------------------------------------------------------------------------------


def test_coll_mod_logs_new_and_old_options(dep: Deployment) -> None:
    run(dep, {"create": "c", "validator": {"a": 1}})
    run(dep, {"createIndexes": "c", "indexes": [{"key": {"a": 1}, "name": "a_1"}]})
    coll_uuid = uuid_of(dep, "c")
    start = since(dep)
    run(dep, {"collMod": "c", "changeStreamPreAndPostImages": {"enabled": True}})
    reply = run(dep, {"collMod": "c", "index": {"keyPattern": {"a": 1}, "hidden": True}})
    assert reply == {"hidden_old": False, "hidden_new": True}
    assert run(dep, {"collMod": "c"}) == {}
    images, index, bare = entries(dep, start)
    assert (images.op, images.ns, images.ui) == ("c", "db.$cmd", coll_uuid)
    assert images.o == {"collMod": "c", "changeStreamPreAndPostImages": {"enabled": True}}
    assert images.o2 == {"collectionOptions_old": {"uuid": coll_uuid, "validator": {"a": 1}}}
    assert index.o == {"collMod": "c", "index": {"name": "a_1", "hidden": True}}
    assert index.o2 == {
        "collectionOptions_old": {
            "uuid": coll_uuid,
            "changeStreamPreAndPostImages": {"enabled": True},
            "validator": {"a": 1},
        },
        "indexOptions_old": {"hidden": False},
    }
    assert bare.o == {"collMod": "c"}
    state = dep.catalog.get("db", "c")
    assert state is not None and state.pre_post_images
    assert state.index("a_1") == {"v": 2, "key": {"a": 1}, "name": "a_1", "hidden": True}
    assert failure(dep, {"collMod": "nope"}).code == 26


# -- listings --------------------------------------------------------------------------------------------------


def test_list_collections_entries_and_cursor(dep: Deployment) -> None:
    for name in ("b", "a", "c"):
        run(dep, {"create": name})
    reply = run(
        dep, {"listCollections": 1, "filter": {"name": {"$ne": "c"}}, "cursor": {"batchSize": 1}}
    )
    cursor = reply["cursor"]
    assert cursor["ns"] == "db.$cmd.listCollections" and cursor["id"] != 0
    assert cursor["firstBatch"] == [
        {
            "name": "a",
            "type": "collection",
            "options": {},
            "info": {"readOnly": False, "uuid": uuid_of(dep, "a")},
            "idIndex": ID_INDEX,
        }
    ]
    live = dep.cursors.checkout(int(cursor["id"]), dep.members[0].name)
    rest = live.get_more(None, None, None)  # type: ignore[arg-type]
    assert [d["name"] for d in rest.documents] == ["b"] and rest.exhausted


def test_list_databases(dep: Deployment) -> None:
    run(dep, {"insert": "c", "documents": [{"x": 1}]})
    names = run(dep, {"listDatabases": 1, "nameOnly": True}, db="admin")
    assert names == {"databases": [{"name": n} for n in ("admin", "config", "db", "local")]}
    full = run(dep, {"listDatabases": 1, "filter": {"name": "db"}}, db="admin")
    (entry,) = full["databases"]
    assert list(entry) == ["name", "sizeOnDisk", "empty"] and entry["sizeOnDisk"] > 0
    assert full["totalSize"] == entry["sizeOnDisk"] and full["totalSizeMb"] == 0
    assert REGISTRY["listDatabases"].admin_only


def test_ddl_refused_in_transactions(dep: Deployment) -> None:
    ctx = CommandContext(
        deployment=dep,
        member=dep.members[0],
        connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db="db",
        name="drop",
        body={"drop": "c"},
        lsid={"id": uuid.uuid4()},
        txn_number=1,
        autocommit=False,
        start_transaction=True,
    )
    with pytest.raises(CommandError) as info:
        REGISTRY["drop"].handler(ctx)
    assert (info.value.code, info.value.errmsg) == (
        263,
        "Cannot run 'drop' in a multi-document transaction.",
    )
