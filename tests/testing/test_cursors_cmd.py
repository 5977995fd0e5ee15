"""getMore / killCursors over the wire, with cursors registered straight in the CursorManager."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from bson.int64 import Int64
from pymongo import CursorType, MongoClient, monitoring
from pymongo.client_session import ClientSession
from pymongo.errors import OperationFailure
from support import raw_command

from changestream.testing import ReplicaSet
from changestream.testing.commands import CommandContext
from changestream.testing.core.cursors import CursorBatch
from changestream.testing.core.errors import CommandError

Client = MongoClient[dict[str, Any]]


class FakeCursor:
    """A ServerCursor handing out ``docs`` in batches (default batch: 2)."""

    def __init__(
        self,
        docs: list[dict[str, Any]],
        *,
        ns: str = "db.coll",
        lsid_id: bytes | None = None,
        tailable_await: bool = False,
        is_change_stream: bool = False,
        error: CommandError | None = None,
    ) -> None:
        self.docs = list(docs)
        self.ns = ns
        self.lsid_id = lsid_id
        self.tailable_await = tailable_await
        self.is_change_stream = is_change_stream
        self.error = error
        self.calls: list[tuple[int | None, int | None]] = []
        self.closed = False

    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch:
        self.calls.append((batch_size, max_time_ms))
        if self.error is not None:
            raise self.error
        n = batch_size or 2
        batch, self.docs = self.docs[:n], self.docs[n:]
        return CursorBatch(batch, exhausted=not self.docs and not self.tailable_await)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as replset:
        yield replset


@pytest.fixture
def client(rs: ReplicaSet) -> Iterator[Client]:
    c: Client = MongoClient(rs.uri, serverSelectionTimeoutMS=5000)
    yield c
    c.admin.command("configureFailPoint", "failGetMoreAfterCursorCheckout", mode="off")
    c.close()


@pytest.fixture
def session(client: Client) -> Iterator[ClientSession]:
    """The session the fake cursors are opened in (PyMongo always sends an ``lsid``)."""
    with client.start_session() as s:
        yield s


def register(rs: ReplicaSet, cursor: FakeCursor, session: ClientSession | None = None) -> int:
    """Register ``cursor`` on the primary, opened in ``session`` when given."""
    assert rs.primary is not None
    if session is not None:
        cursor.lsid_id = bytes(session.session_id["id"])
    return rs.deployment.cursors.register(cursor, rs.primary)


def get_more(
    client: Client,
    cid: int,
    coll: str = "coll",
    session: ClientSession | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    return client.db.command("getMore", Int64(cid), collection=coll, session=session, **kwargs)


def error_of(call: Any) -> dict[str, Any]:
    with pytest.raises(OperationFailure) as exc:
        call()
    assert exc.value.details is not None
    return dict(exc.value.details)


def test_get_more_batches_until_exhausted(
    rs: ReplicaSet, client: Client, session: ClientSession
) -> None:
    cursor = FakeCursor([{"_id": i} for i in range(5)])
    cid = register(rs, cursor, session)
    reply = get_more(client, cid, session=session, batchSize=3)
    assert list(reply) == ["cursor", "ok", "$clusterTime", "operationTime"]
    assert reply["cursor"] == {
        "nextBatch": [{"_id": 0}, {"_id": 1}, {"_id": 2}],
        "id": cid,
        "ns": "db.coll",
    }
    last = get_more(client, cid, session=session)
    assert last["cursor"]["nextBatch"] == [{"_id": 3}, {"_id": 4}] and last["cursor"]["id"] == 0
    assert cursor.calls == [(3, None), (None, None)] and cursor.closed
    assert error_of(lambda: get_more(client, cid, session=session))["code"] == 43


def test_get_more_argument_validation(
    rs: ReplicaSet, client: Client, session: ClientSession
) -> None:
    cursor = FakeCursor([{"_id": 1}] * 10)
    cid = register(rs, cursor, session)
    err = error_of(lambda: client.db.command("getMore", 5, collection="coll"))  # an int32 id
    assert err["code"] == 14
    assert (
        err["errmsg"]
        == "BSON field 'getMore.getMore' is the wrong type 'int', expected type 'long'"
    )
    err = error_of(lambda: client.db.command("getMore", Int64(cid), collection=5))
    assert err["code"] == 14 and "getMore.collection" in err["errmsg"]
    err = error_of(lambda: get_more(client, cid, session=session, batchSize=0))
    assert (err["code"], err["errmsg"]) == (
        2,
        "Batch size for getMore must be positive, but received: 0",
    )
    err = error_of(lambda: get_more(client, cid, session=session, maxTimeMS=100))
    assert (err["code"], err["errmsg"]) == (
        2,
        "cannot set maxTimeMS on getMore command for a non-awaitData cursor",
    )
    err = error_of(lambda: get_more(client, cid, session=session, coll="other"))
    assert err["code"] == 13
    assert err["errmsg"] == (
        "Requested getMore on namespace 'db.other', but cursor belongs to a different namespace db.coll"
    )
    # validation errors leave the cursor usable
    assert cursor.calls == []
    assert get_more(client, cid, session=session)["cursor"]["nextBatch"] == [{"_id": 1}] * 2


def test_await_cursor_gets_max_time_ms(
    rs: ReplicaSet, client: Client, session: ClientSession
) -> None:
    cursor = FakeCursor([{"_id": 1}], tailable_await=True)
    cid = register(rs, cursor, session)
    assert get_more(client, cid, session=session, maxTimeMS=250)["cursor"]["id"] == cid
    assert cursor.calls == [(None, 250)]


def test_unknown_cursor(client: Client) -> None:
    err = error_of(lambda: get_more(client, 12345))
    assert (err["code"], err["codeName"], err["errmsg"]) == (
        43,
        "CursorNotFound",
        "cursor id 12345 not found",
    )


def test_cursor_created_in_a_session_needs_that_session(rs: ReplicaSet, client: Client) -> None:
    with client.start_session() as owner, client.start_session() as stranger:
        owner_id = bytes(owner.session_id["id"])
        cid = register(rs, FakeCursor([{"_id": 1}] * 10, lsid_id=owner_id))
        err = error_of(lambda: get_more(client, cid, session=stranger))
        assert err["code"] == 50738 and "in session" in err["errmsg"]
        assert get_more(client, cid, session=owner)["ok"] == 1.0


def test_cursor_created_in_a_session_rejects_a_get_more_without_lsid(rs: ReplicaSet) -> None:
    cid = register(rs, FakeCursor([{"_id": 1}] * 10, lsid_id=b"\x01" * 16))
    assert rs.primary is not None
    reply = raw_command(rs.primary, {"getMore": Int64(cid), "collection": "coll", "$db": "db"})
    assert reply["code"] == 50737 and "without an lsid" in reply["errmsg"]


def test_error_during_get_more_deletes_the_cursor(
    rs: ReplicaSet, client: Client, session: ClientSession
) -> None:
    cursor = FakeCursor([{"_id": 1}], error=CommandError(2, "boom"))
    cid = register(rs, cursor, session)
    assert error_of(lambda: get_more(client, cid, session=session))["errmsg"] == "boom"
    assert cursor.closed
    assert error_of(lambda: get_more(client, cid, session=session))["code"] == 43


def test_fail_get_more_after_cursor_checkout_labels_change_streams(
    rs: ReplicaSet, client: Client, session: ClientSession
) -> None:
    client.admin.command(
        "configureFailPoint",
        "failGetMoreAfterCursorCheckout",
        mode={"times": 1},
        data={"errorCode": 6},
    )
    cursor = FakeCursor([{"_id": 1}], ns="db.coll", tailable_await=True, is_change_stream=True)
    cid = register(rs, cursor, session)
    err = error_of(lambda: get_more(client, cid, session=session))
    assert (err["code"], err["errmsg"]) == (6, "Hit the 'failGetMoreAfterCursorCheckout' failpoint")
    assert err["errorLabels"] == ["ResumableChangeStreamError"]
    assert cursor.calls == [] and cursor.closed  # fired after checkout, before the batch: deleted
    assert error_of(lambda: get_more(client, cid, session=session))["code"] == 43


def test_fail_get_more_after_cursor_checkout_defaults_and_filters(
    rs: ReplicaSet, client: Client, session: ClientSession
) -> None:
    client.admin.command(
        "configureFailPoint",
        "failGetMoreAfterCursorCheckout",
        mode="alwaysOn",
        data={"namespace": "db.other"},
    )
    plain = register(rs, FakeCursor([{"_id": 1}] * 4), session)
    assert get_more(client, plain, session=session)["ok"] == 1.0  # other namespace: not fired
    target = register(rs, FakeCursor([{"_id": 1}] * 4, ns="db.other"), session)
    err = error_of(lambda: get_more(client, target, session=session, coll="other"))
    assert (err["code"], err["codeName"]) == (1, "InternalError")
    assert "errorLabels" not in err  # not a change stream


def test_fail_command_on_get_more_keeps_the_cursor_and_has_no_label(
    rs: ReplicaSet, client: Client, session: ClientSession
) -> None:
    cursor = FakeCursor([{"_id": 1}] * 4, tailable_await=True, is_change_stream=True)
    cid = register(rs, cursor, session)
    client.admin.command(
        "configureFailPoint",
        "failCommand",
        mode={"times": 1},
        data={"failCommands": ["getMore"], "errorCode": 6},
    )
    err = error_of(lambda: get_more(client, cid, session=session))
    assert err["code"] == 6 and "errorLabels" not in err  # SERVER-46091: fires before checkout
    assert get_more(client, cid, session=session)["cursor"]["nextBatch"] == [{"_id": 1}] * 2


def test_kill_cursors(rs: ReplicaSet, client: Client, session: ClientSession) -> None:
    first = FakeCursor([{"_id": 1}] * 4)
    a, b = register(rs, first, session), register(rs, FakeCursor([{"_id": 1}] * 4), session)
    reply = client.db.command("killCursors", "coll", cursors=[Int64(a), Int64(b), Int64(999)])
    assert reply["cursorsKilled"] == [a, b] and all(
        isinstance(c, Int64) for c in reply["cursorsKilled"]
    )
    assert reply["cursorsNotFound"] == [999]
    assert reply["cursorsAlive"] == [] and reply["cursorsUnknown"] == []
    assert first.closed
    assert error_of(lambda: get_more(client, a, session=session))["code"] == 43


def test_replica_set_kill_cursors(rs: ReplicaSet, client: Client, session: ClientSession) -> None:
    cids = [register(rs, FakeCursor([{"_id": 1}] * 4), session) for _ in range(3)]
    assert rs.kill_cursors() >= 3
    for cid in cids:
        assert error_of(lambda cid=cid: get_more(client, cid, session=session))["code"] == 43


def test_cursors_live_on_one_member() -> None:
    with ReplicaSet("8.0", members=2) as rs:
        primary, secondary = rs.members
        with (
            MongoClient(f"mongodb://{primary}/?directConnection=true") as on_primary,
            MongoClient(f"mongodb://{secondary}/?directConnection=true") as on_secondary,
            on_primary.start_session() as session,
        ):
            cursor = FakeCursor([{"_id": 1}] * 4, lsid_id=bytes(session.session_id["id"]))
            cid = rs.deployment.cursors.register(cursor, primary)
            assert error_of(lambda: get_more(on_secondary, cid))["code"] == 43
            assert get_more(on_primary, cid, session=session)["ok"] == 1.0


def test_cursor_created_outside_a_session_rejects_a_get_more_in_one(
    rs: ReplicaSet, client: Client, session: ClientSession
) -> None:
    cid = register(rs, FakeCursor([{"_id": 1}] * 10))
    err = error_of(lambda: get_more(client, cid, session=session))
    shown = str(session.session_id["id"].as_uuid())
    assert (err["code"], err["errmsg"]) == (
        50736,
        f"Cannot run getMore on cursor {cid}, which was not created in a session, in session "
        f"{shown}",
    )
    assert rs.primary is not None
    reply = raw_command(rs.primary, {"getMore": Int64(cid), "collection": "coll", "$db": "db"})
    assert reply["ok"] == 1.0  # without an lsid it may continue


# -- with real find cursors ------------------------------------------------------------------------


class GetMores(monitoring.CommandListener):
    def __init__(self) -> None:
        self.replies: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name == "getMore":
            self.replies.append(dict(event.reply))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.mark.parametrize("cursor_type", [CursorType.NON_TAILABLE, CursorType.EXHAUST])
def test_find_cursor_is_iterated_with_get_more(rs: ReplicaSet, cursor_type: int) -> None:
    listener = GetMores()
    before = set(rs.deployment.cursors.ids())
    with MongoClient(rs.uri, event_listeners=[listener]) as client:
        coll = client.db[f"find_{cursor_type}"]
        coll.insert_many([{"_id": i} for i in range(7)])
        docs = list(coll.find(batch_size=2, cursor_type=cursor_type).sort("_id", 1))
        assert [d["_id"] for d in docs] == list(range(7))
        # 2 in the first batch, then 2 + 2 + 1 in getMores; the last one closes the cursor
        assert [len(r["cursor"]["nextBatch"]) for r in listener.replies] == [2, 2, 1]
        assert listener.replies[-1]["cursor"]["id"] == 0
        assert set(rs.deployment.cursors.ids()) == before


def test_closing_a_find_cursor_kills_it_on_the_server(rs: ReplicaSet, client: Client) -> None:
    coll = client.db.closing
    coll.insert_many([{"_id": i} for i in range(5)])
    before = set(rs.deployment.cursors.ids())
    cursor = coll.find(batch_size=2)
    next(cursor)
    assert len(set(rs.deployment.cursors.ids()) - before) == 1
    cursor.close()
    assert set(rs.deployment.cursors.ids()) == before
