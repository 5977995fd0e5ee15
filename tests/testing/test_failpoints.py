"""configureFailPoint / failCommand as PyMongo observes them (mongod's semantics, server-notes §4)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient, monitoring
from pymongo.errors import AutoReconnect, OperationFailure, WriteConcernError

from changestream.testing import ReplicaSet

Client = MongoClient[dict[str, Any]]


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as replset:
        yield replset


@pytest.fixture
def client(rs: ReplicaSet) -> Iterator[Client]:
    c: Client = MongoClient(rs.uri, serverSelectionTimeoutMS=5000, retryReads=False)
    yield c
    c.admin.command("configureFailPoint", "failCommand", mode="off")
    c.close()


def fail(client: Client, mode: Any = "alwaysOn", **data: Any) -> dict[str, Any]:
    return client.admin.command("configureFailPoint", "failCommand", mode=mode, data=data)


def error_of(call: Any) -> dict[str, Any]:
    """The server's error document of a failing call."""
    with pytest.raises(OperationFailure) as exc:
        call()
    assert exc.value.details is not None
    return dict(exc.value.details)


def ping(client: Client) -> dict[str, Any]:
    return client.admin.command("ping")


# -- configureFailPoint itself -----------------------------------------------------------------------


def test_only_on_admin_and_only_known_failpoints(client: Client) -> None:
    err = error_of(lambda: client.test.command("configureFailPoint", "failCommand", mode="off"))
    assert err["code"] == 13
    assert err["errmsg"] == "configureFailPoint may only be run against the admin database."
    err = error_of(
        lambda: client.admin.command("configureFailPoint", "noSuchFailPoint", mode="off")
    )
    assert (err["code"], err["codeName"]) == (266, "FailPointSetFailed")
    assert err["errmsg"] == "noSuchFailPoint not found"


@pytest.mark.parametrize(
    ("mode", "data", "code", "message"),
    [
        (None, None, 20, "When setting a failpoint, you must supply a 'mode'"),
        ("sometimes", None, 2, "unknown mode: sometimes"),
        (7, None, 14, "'mode' must be a string or JSON object"),
        ({"times": -1}, None, 2, "'times' option to 'mode' must be positive"),
        ({"skip": -3}, None, 2, "'skip' option to 'mode' must be positive"),
        ({"times": "x"}, None, 2, "'times' option to 'mode' must be a number"),
        ({"often": 1}, None, 2, "'mode' must be one of 'off', 'alwaysOn', '{times:n}', '{skip:n}' or '{activationProbability:p}'"),
        ({"activationProbability": "x"}, None, 14, "'activationProbability' option to 'mode' must be a double"),
        ({"activationProbability": 1.5}, None, 2, "'activationProbability' option to 'mode' must be between 0 and 1"),
        ("alwaysOn", 5, 14, "the 'data' field must be a JSON object"),
    ],
)  # fmt: skip
def test_mode_and_data_validation(
    client: Client, mode: Any, data: Any, code: int, message: str
) -> None:
    cmd: dict[str, Any] = {"configureFailPoint": "failCommand"}
    if mode is not None:
        cmd["mode"] = mode
    if data is not None:
        cmd["data"] = data
    err = error_of(lambda: client.admin.command(cmd))
    assert (err["code"], err["errmsg"]) == (code, message)


def test_count_reports_times_entered_before_the_change(client: Client) -> None:
    start = fail(client, "off")["count"]
    fail(client, errorCode=2, failCommands=["ping"])
    for _ in range(3):
        error_of(lambda: ping(client))
    assert fail(client, "off")["count"] == start + 3
    assert fail(client, "off")["count"] == start + 3  # cumulative, not reset by a new mode


def test_configure_fail_point_is_never_failed(client: Client) -> None:
    fail(client, errorCode=2, failCommands=["configureFailPoint", "ping"])
    assert error_of(lambda: ping(client))["code"] == 2
    assert fail(client, "off")["ok"] == 1.0
    assert ping(client)["ok"] == 1.0


def test_wait_for_fail_point(client: Client) -> None:
    count = fail(client, errorCode=2, failCommands=["ping"])["count"]
    error_of(lambda: ping(client))
    reply = client.admin.command(
        "waitForFailPoint", "failCommand", timesEntered=count + 1, maxTimeMS=1000
    )
    assert reply["ok"] == 1.0
    err = error_of(
        lambda: client.admin.command(
            "waitForFailPoint", "failCommand", timesEntered=count + 5, maxTimeMS=100
        )
    )
    assert err["code"] == 50


# -- failCommand data ---------------------------------------------------------------------------------


def test_error_code_and_code_name(client: Client) -> None:
    fail(client, errorCode=2, failCommands=["ping"])
    err = error_of(lambda: ping(client))
    assert (err["ok"], err["code"], err["codeName"]) == (0.0, 2, "BadValue")
    assert err["errmsg"] == "Failing command via 'failCommand' failpoint"
    assert "errorLabels" not in err and "$clusterTime" in err and "operationTime" in err
    fail(client, errorCode=12345, failCommands=["ping"])
    assert error_of(lambda: ping(client))["codeName"] == "Location12345"


def test_only_listed_commands_and_aliases_fail(client: Client) -> None:
    fail(client, errorCode=2, failCommands=["isMaster"])
    assert error_of(lambda: client.admin.command("ismaster"))["code"] == 2  # alias of isMaster
    assert client.admin.command("hello")["ok"] == 1.0  # a command of its own in mongod
    assert ping(client)["ok"] == 1.0


def test_error_labels_replace_computed_labels(client: Client) -> None:
    fail(client, errorCode=286, failCommands=["ping"])  # mongod labels 286 by itself
    assert error_of(lambda: ping(client))["errorLabels"] == ["NonResumableChangeStreamError"]
    fail(client, errorCode=286, failCommands=["ping"], errorLabels=["Custom", "Other"])
    assert error_of(lambda: ping(client))["errorLabels"] == ["Custom", "Other"]
    fail(client, errorCode=286, failCommands=["ping"], errorLabels=[])
    assert "errorLabels" not in error_of(lambda: ping(client))


def test_not_primary_error_carries_topology_version(client: Client, rs: ReplicaSet) -> None:
    fail(client, {"times": 1}, errorCode=10107, failCommands=["buildInfo"])
    with pytest.raises(AutoReconnect) as exc:  # PyMongo's NotPrimaryError
        client.admin.command("buildInfo")
    details = getattr(exc.value, "details", None)
    assert details is not None and details["code"] == 10107
    member = rs.deployment.members[0]
    assert details["topologyVersion"] == {
        "processId": member.process_id,
        "counter": member.topology_counter,
    }


def test_close_connection(client: Client) -> None:
    fail(client, {"times": 1}, closeConnection=True, failCommands=["ping"])
    with pytest.raises(AutoReconnect):
        ping(client)
    assert ping(client)["ok"] == 1.0


def test_close_connection_takes_precedence_over_error_code(client: Client) -> None:
    fail(client, {"times": 1}, closeConnection=True, errorCode=2, failCommands=["ping"])
    with pytest.raises(AutoReconnect):
        ping(client)


def test_block_connection(client: Client) -> None:
    fail(client, {"times": 1}, blockConnection=True, blockTimeMS=300, failCommands=["ping"])
    start = time.monotonic()
    assert ping(client)["ok"] == 1.0  # blocked, then runs normally
    assert 0.28 <= time.monotonic() - start < 3
    fail(
        client,
        {"times": 1},
        blockConnection=True,
        blockTimeMS=200,
        errorCode=2,
        failCommands=["ping"],
    )
    start = time.monotonic()
    assert error_of(lambda: ping(client))["code"] == 2
    assert 0.18 <= time.monotonic() - start < 3


@pytest.mark.parametrize("block", [None, -5])
def test_block_connection_needs_a_non_negative_block_time(client: Client, block: Any) -> None:
    data: dict[str, Any] = {"blockConnection": True, "failCommands": ["ping"]}
    if block is not None:
        data["blockTimeMS"] = block
    fail(client, **data)
    err = error_of(lambda: ping(client))
    assert (err["code"], err["codeName"]) == (72, "InvalidOptions")


def test_a_failpoint_without_an_action_never_fires(client: Client) -> None:
    before = fail(client, {"times": 1}, failCommands=["ping"], errorLabels=["X"])["count"]
    assert ping(client)["ok"] == 1.0
    assert "errorLabels" not in ping(client)
    assert fail(client, "off")["count"] == before  # never entered


def test_app_name_filter(client: Client, rs: ReplicaSet) -> None:
    fail(client, errorCode=2, failCommands=["ping"], appName="victim")
    assert ping(client)["ok"] == 1.0
    with MongoClient(rs.uri, appname="victim", serverSelectionTimeoutMS=5000) as victim:
        assert error_of(lambda: ping(victim))["code"] == 2


class _Heartbeats(monitoring.ServerHeartbeatListener):
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def started(self, event: monitoring.ServerHeartbeatStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.ServerHeartbeatSucceededEvent) -> None:
        self.outcomes.append("succeeded")

    def failed(self, event: monitoring.ServerHeartbeatFailedEvent) -> None:
        details = getattr(event.reply, "details", None) or {}
        self.outcomes.append(f"failed: {details.get('code')}")


def test_app_name_filter_fails_the_first_hello_of_a_new_connection(
    client: Client, rs: ReplicaSet
) -> None:
    """mongod reads a hello's client metadata before failCommand, so a failpoint for one
    ``appName`` fails the handshake of that application's new connections too (issue 33,
    item 20: the Node.js driver's "should resume on ServerSelectionError" tests)."""
    fail(client, errorCode=91, failCommands=["hello", "isMaster"], appName="monitored")
    heartbeats = _Heartbeats()
    monitored: Client = MongoClient(
        rs.uri, appname="monitored", event_listeners=[heartbeats], heartbeatFrequencyMS=500,
        serverSelectionTimeoutMS=1500,
    )  # fmt: skip
    with monitored, pytest.raises(Exception, match="Failing command via 'failCommand' failpoint"):
        ping(monitored)
    assert heartbeats.outcomes, "the monitor checked the server"
    assert set(heartbeats.outcomes) == {"failed: 91"}, heartbeats.outcomes
    assert ping(client)["ok"] == 1.0  # another application's hellos pass


def test_namespace_filter(client: Client) -> None:
    fail(client, errorCode=2, failCommands=["killCursors"], namespace="db.a")
    assert error_of(lambda: client.db.command("killCursors", "a", cursors=[]))["code"] == 2
    assert client.db.command("killCursors", "b", cursors=[])["ok"] == 1.0
    assert client.other.command("killCursors", "a", cursors=[])["ok"] == 1.0


def test_times_counts_only_matching_commands(client: Client) -> None:
    fail(client, {"times": 2}, errorCode=2, failCommands=["ping"])
    for _ in range(3):
        client.admin.command("buildInfo")  # not listed: does not consume "times"
    assert error_of(lambda: ping(client))["code"] == 2
    assert error_of(lambda: ping(client))["code"] == 2
    assert ping(client)["ok"] == 1.0


def test_skip_lets_the_first_n_pass(client: Client) -> None:
    fail(client, {"skip": 2}, errorCode=2, failCommands=["ping"])
    assert ping(client)["ok"] == 1.0
    assert ping(client)["ok"] == 1.0
    for _ in range(3):
        assert error_of(lambda: ping(client))["code"] == 2


@pytest.mark.parametrize(("probability", "fails"), [(0, False), (1, True)])
def test_activation_probability(client: Client, probability: float, fails: bool) -> None:
    fail(client, {"activationProbability": probability}, errorCode=2, failCommands=["ping"])
    for _ in range(10):
        if fails:
            assert error_of(lambda: ping(client))["code"] == 2
        else:
            assert ping(client)["ok"] == 1.0


def test_failpoints_are_per_member() -> None:
    with ReplicaSet("8.0", members=2) as rs:
        primary, secondary = rs.members
        with MongoClient(f"mongodb://{secondary}/?directConnection=true") as direct:
            fail(direct, errorCode=2, failCommands=["ping"])
            assert error_of(lambda: ping(direct))["code"] == 2
        with MongoClient(f"mongodb://{primary}/?directConnection=true") as other:
            assert ping(other)["ok"] == 1.0


# -- with write commands ---------------------------------------------------------------------------


def test_write_concern_error_is_appended_to_a_successful_write(client: Client) -> None:
    fail(
        client,
        {"times": 1},
        failCommands=["insert"],
        writeConcernError={"code": 100, "codeName": "UnsatisfiableWriteConcern", "errmsg": "nope"},
    )
    with pytest.raises(WriteConcernError) as exc:
        client.db.wce.insert_one({"_id": 1})
    assert exc.value.code == 100
    assert client.db.wce.find_one({"_id": 1}) == {"_id": 1}  # the write itself happened
    fail(
        client, "alwaysOn", failCommands=["insert"], writeConcernError={"code": 100, "errmsg": "x"}
    )
    assert ping(client)["ok"] == 1.0  # ping takes no write concern


def test_retryable_write_errors_get_the_retryable_write_label(
    client: Client, rs: ReplicaSet
) -> None:
    fail(client, {"times": 1}, errorCode=91, failCommands=["insert"])
    # an injected shutdown error carries no topologyVersion (as with mongod): PyMongo
    # marks the server Unknown until its next hello, so this client polls fast
    with MongoClient(rs.uri, heartbeatFrequencyMS=500, serverSelectionTimeoutMS=5000) as fast:
        fast.db.retry.insert_one({"_id": 1})  # labelled RetryableWriteError: PyMongo retried
    assert client.db.retry.count_documents({}) == 1
    with MongoClient(rs.uri, retryWrites=False, serverSelectionTimeoutMS=5000) as plain:
        fail(client, {"times": 1}, errorCode=2, failCommands=["insert"])
        err = error_of(lambda: plain.db.retry.insert_one({"_id": 2}))
        assert err["code"] == 2 and "errorLabels" not in err


class Replies(monitoring.CommandListener):
    def __init__(self, name: str) -> None:
        self.name = name
        self.replies: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name == self.name:
            self.replies.append(dict(event.reply))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_retryable_write_concern_error_is_labelled_and_retried(rs: ReplicaSet) -> None:
    # a shutdown WCE (no topologyVersion) marks the server Unknown until the next
    # streamed hello, as with mongod: poll fast so the retry finds it again
    updates = Replies("update")
    with MongoClient(
        rs.uri, heartbeatFrequencyMS=500, serverSelectionTimeoutMS=5000, event_listeners=[updates]
    ) as client:
        client.db.wce_retry.insert_one({"_id": 1})
        fail(
            client,
            {"times": 1},
            failCommands=["update"],
            writeConcernError={"code": 91, "errmsg": "Replication is being shut down"},
        )
        client.db.wce_retry.update_one({"_id": 1}, {"$set": {"x": 1}})
        assert client.db.wce_retry.find_one() == {"_id": 1, "x": 1}
    first, retry = updates.replies
    assert first["writeConcernError"] == {"code": 91, "errmsg": "Replication is being shut down"}
    assert first["errorLabels"] == ["RetryableWriteError"]
    assert "writeConcernError" not in retry


def test_transient_transaction_error_label(client: Client) -> None:
    client.db.txn.insert_one({"_id": 0})
    fail(client, {"times": 1}, errorCode=112, failCommands=["insert"])
    with client.start_session() as session:
        session.start_transaction()
        err = error_of(lambda: client.db.txn.insert_one({"_id": 1}, session=session))
        session.abort_transaction()
    assert err["code"] == 112 and err["errorLabels"] == ["TransientTransactionError"]
