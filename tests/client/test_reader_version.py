"""``version`` and ``ignore_removed_shards``: the ``$changeStream`` options of MongoDB 8.2 and 9.0.

mongod's IDL (``document_source_change_stream.idl``): ``version`` is the enum
``ChangeStreamReaderVersion`` (``"v1"``, ``"v2"``) since 8.2; ``ignoreRemovedShards``
a bool since 9.0. An older server refuses either as an unknown field (40415).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import OperationFailure

import changestream
from changestream._options import ChangeStreamOptions
from changestream.testing import ReplicaSet
from tests.support import Recorder


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"version": 2}, TypeError, "version must be a string such as 'v2', not int"),
        ({"version": "2"}, ValueError, r"reader version, 'v1' or 'v2' \(MongoDB 8.2\+\), not '2'"),
        ({"version": "v0"}, ValueError, "not 'v0'"),
        ({"ignore_removed_shards": "yes"}, TypeError, "ignore_removed_shards must be a bool"),
    ],
)
def test_bad_values_are_refused_naming_the_option(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        ChangeStreamOptions.from_kwargs(None, **options)


def test_a_later_reader_version_is_left_to_the_server() -> None:
    assert ChangeStreamOptions.from_kwargs(None, version="v3").version == "v3"


@pytest.fixture(scope="module")
def rs82() -> Any:
    with ReplicaSet("8.2", members=1) as rs:
        yield rs


@pytest.fixture(scope="module")
def rs80() -> Any:
    with ReplicaSet("8.0", members=1) as rs:
        yield rs


def test_version_is_sent_and_kept_on_resume(rs82: Any) -> None:
    recorder = Recorder()
    client: MongoClient[Any] = MongoClient(rs82.uri, event_listeners=[recorder])
    try:
        coll = client.db.reader_version
        coll.insert_one({"_id": 0})
        with changestream.watch(coll, version="v2") as stream:
            coll.insert_one({"_id": 1})
            assert next(stream)["documentKey"] == {"_id": 1}
            client.admin.command(
                "configureFailPoint", "failCommand", mode={"times": 1},
                data={"failCommands": ["getMore"], "errorCode": 6,
                      "errorLabels": ["ResumableChangeStreamError"]},
            )
            coll.insert_one({"_id": 2})
            assert next(stream)["documentKey"] == {"_id": 2}
            assert stream.resumes == 1
        stages = [recorder.stage(i) for i in range(len(recorder.commands("aggregate")))]
        assert len(stages) == 2
        assert [stage.get("version") for stage in stages] == ["v2", "v2"]
        assert "ignoreRemovedShards" not in stages[0]  # sent only when given
    finally:
        client.close()


def test_the_simulator_refuses_what_mongod_refuses(rs82: Any, rs80: Any) -> None:
    new: MongoClient[Any] = MongoClient(rs82.uri)
    old: MongoClient[Any] = MongoClient(rs80.uri)
    try:
        with pytest.raises(OperationFailure) as bad_enum:
            new.db.command(
                "aggregate", "coll", pipeline=[{"$changeStream": {"version": "v9"}}], cursor={}
            )
        assert bad_enum.value.code == 2
        assert "Enumeration value 'v9' for field '$changeStream.version'" in str(bad_enum.value)
        with pytest.raises(OperationFailure) as too_old:
            changestream.watch(old.db.coll, version="v1")
        assert too_old.value.code == 40415
        with pytest.raises(OperationFailure) as not_yet:
            changestream.watch(new.db.coll, version="v2", ignore_removed_shards=True)
        assert not_yet.value.code == 40415
        assert "ignoreRemovedShards" in str(not_yet.value)
    finally:
        new.close()
        old.close()


def test_a_raw_aggregate_with_version_opens_a_stream(rs82: Any) -> None:
    """PyMongo's ``watch()`` has no ``version`` keyword; its raw ``aggregate`` gets a cursor."""
    client: MongoClient[Any] = MongoClient(rs82.uri)
    try:
        reply = client.db.command(
            "aggregate", "pm", pipeline=[{"$changeStream": {"version": "v1"}}], cursor={}
        )
        assert reply["cursor"]["id"] != 0
    finally:
        client.close()


def test_the_async_twin_takes_the_same_options(rs82: Any) -> None:
    async def run() -> dict[str, Any]:
        client: AsyncMongoClient[Any] = AsyncMongoClient(rs82.uri)
        try:
            coll = client.db.reader_version_async
            async with await changestream.aio.watch(coll, version="v1") as stream:
                await coll.insert_one({"_id": 7})
                change = await stream.next()
                return dict(change["documentKey"])
        finally:
            await client.close()

    assert asyncio.run(run()) == {"_id": 7}
    with pytest.raises(ValueError, match="not 'x'"):
        asyncio.run(changestream.aio.watch(AsyncMongoClient(connect=False).db.c, version="x"))
