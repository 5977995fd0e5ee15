"""The simulator as PyMongo sees it: handshake, hello fields, admin commands, discovery, roles."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from bson.timestamp import Timestamp
from pymongo import MongoClient, ReadPreference, monitoring
from pymongo.errors import NotPrimaryError, OperationFailure
from support import raw_command

from changestream.testing import ReplicaSet

Client = MongoClient[dict[str, Any]]

RS_HELLO_FIELDS = [
    "topologyVersion", "hosts", "setName", "setVersion", "isWritablePrimary", "secondary",
    "primary", "me", "electionId", "lastWrite", "maxBsonObjectSize", "maxMessageSizeBytes",
    "maxWriteBatchSize", "localTime", "logicalSessionTimeoutMinutes", "connectionId",
    "minWireVersion", "maxWireVersion", "readOnly", "ok", "$clusterTime", "operationTime",
]  # fmt: skip


@pytest.fixture(scope="module")
def rs3() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0", members=3) as rs:
        yield rs


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> float:
    """Poll ``predicate``; return the seconds it took (fail after ``timeout``)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(0.02)
    return time.monotonic() - start


def secondaries(rs: ReplicaSet) -> list[str]:
    return [m for m in rs.members if m != rs.primary]


# -- hello ---------------------------------------------------------------------------------------


def test_hello_on_the_primary_has_mongods_fields_in_order(rs3: ReplicaSet, clients: Any) -> None:
    reply = clients(rs3.uri).admin.command("hello")
    assert list(reply) == RS_HELLO_FIELDS
    assert reply["hosts"] == rs3.members
    assert reply["setName"] == "rs0" and reply["setVersion"] == 1
    assert reply["isWritablePrimary"] is True and reply["secondary"] is False
    assert reply["primary"] == reply["me"] == rs3.primary
    assert str(reply["electionId"]).startswith("7fffffff")
    assert int(str(reply["electionId"])[8:], 16) == rs3.deployment.term
    assert reply["maxBsonObjectSize"] == 16777216
    assert reply["maxMessageSizeBytes"] == 48000000
    assert reply["maxWriteBatchSize"] == 100000
    assert reply["logicalSessionTimeoutMinutes"] == 30
    assert (reply["minWireVersion"], reply["maxWireVersion"]) == (0, 25)
    assert reply["readOnly"] is False
    assert list(reply["topologyVersion"]) == ["processId", "counter"]
    assert list(reply["lastWrite"]) == [
        "opTime",
        "lastWriteDate",
        "majorityOpTime",
        "majorityWriteDate",
    ]
    assert isinstance(reply["lastWrite"]["opTime"]["ts"], Timestamp)
    assert list(reply["$clusterTime"]) == ["clusterTime", "signature"]
    assert reply["$clusterTime"]["signature"]["hash"] == b"\x00" * 20


def test_hello_on_a_secondary(rs3: ReplicaSet, clients: Any) -> None:
    member = secondaries(rs3)[0]
    reply = clients(f"mongodb://{member}/?directConnection=true").admin.command("hello")
    assert reply["isWritablePrimary"] is False and reply["secondary"] is True
    assert reply["primary"] == rs3.primary and reply["me"] == member
    assert "electionId" not in reply
    assert list(reply) == [f for f in RS_HELLO_FIELDS if f != "electionId"]


def test_legacy_is_master_reports_ismaster_and_hello_ok(rs3: ReplicaSet, clients: Any) -> None:
    reply = clients(rs3.uri).admin.command("isMaster", helloOk=True)
    assert next(iter(reply)) == "helloOk" and reply["helloOk"] is True
    assert reply["ismaster"] is True and "isWritablePrimary" not in reply


@pytest.mark.parametrize(("version", "wire_version"), [("4.4", 9), ("6.0", 17), ("7.0", 21)])
def test_max_wire_version_follows_the_version(
    version: str, wire_version: int, start_rs: Any, clients: Any
) -> None:
    rs = start_rs(version)
    client = clients(rs.uri)
    assert client.admin.command("hello")["maxWireVersion"] == wire_version
    info = client.admin.command("buildInfo")
    assert info["version"].startswith(version + ".")
    assert info["versionArray"][:2] == [int(p) for p in version.split(".")]


def test_standalone_hello_and_replies_without_cluster_time(start_rs: Any, clients: Any) -> None:
    rs = start_rs("8.0", standalone=True)
    assert rs.uri == f"mongodb://{rs.members[0]}/"
    client = clients(rs.uri)
    reply = client.admin.command("hello")
    assert list(reply) == [
        "isWritablePrimary", "topologyVersion", "maxBsonObjectSize", "maxMessageSizeBytes",
        "maxWriteBatchSize", "localTime", "logicalSessionTimeoutMinutes", "connectionId",
        "minWireVersion", "maxWireVersion", "readOnly", "ok",
    ]  # fmt: skip
    assert "$clusterTime" not in client.admin.command("ping")
    assert client.topology_description.topology_type_name == "Single"
    with pytest.raises(OperationFailure) as exc:
        client.admin.command("replSetGetStatus")
    assert exc.value.code == 76


def test_client_metadata_may_only_be_sent_once(rs3: ReplicaSet, clients: Any) -> None:
    with pytest.raises(OperationFailure) as exc:
        clients(rs3.uri).admin.command("hello", client={"driver": {"name": "x"}})
    assert exc.value.code == 186


# -- other admin commands ---------------------------------------------------------------------------


def test_build_info_and_ping(rs3: ReplicaSet, clients: Any) -> None:
    client = clients(rs3.uri)
    info = client.admin.command("buildinfo")
    assert info["version"] == "8.0.4" and info["versionArray"] == [8, 0, 4, 0]
    assert info["maxBsonObjectSize"] == 16777216
    assert client.test.command("ping")["ok"] == 1.0


def test_get_parameter(rs3: ReplicaSet, clients: Any) -> None:
    admin = clients(rs3.uri).admin
    everything = admin.command("getParameter", "*")
    assert everything["featureCompatibilityVersion"] == {"version": "8.0"}
    named = admin.command({"getParameter": 1, "enableTestCommands": 1})
    assert named["enableTestCommands"] is True and "logLevel" not in named
    with pytest.raises(OperationFailure) as exc:
        admin.command({"getParameter": 1, "noSuchKnob": 1})
    assert exc.value.code == 72
    with pytest.raises(OperationFailure) as exc:
        clients(rs3.uri).test.command("getParameter", "*")
    assert exc.value.code == 13
    assert (
        str(exc.value.details["errmsg"])
        == "getParameter may only be run against the admin database."
    )


def test_server_status(rs3: ReplicaSet, clients: Any) -> None:
    status = clients(rs3.uri).admin.command("serverStatus")
    assert status["host"] == rs3.primary and status["process"] == "mongod"
    assert status["version"] == "8.0.4"
    assert status["connections"]["current"] >= 1
    assert status["connections"]["totalCreated"] >= status["connections"]["current"]
    assert status["repl"]["setName"] == "rs0" and status["repl"]["isWritablePrimary"] is True


def test_diagnostic_commands(rs3: ReplicaSet, clients: Any) -> None:
    admin = clients(rs3.uri).admin
    assert admin.command("whatsmyuri")["you"].startswith("127.0.0.1:")
    assert admin.command("connectionStatus")["authInfo"]["authenticatedUsers"] == []
    assert "system" in admin.command("hostInfo")
    assert "--replSet" in admin.command("getCmdLineOpts")["argv"]
    assert admin.command("getLog", "*")["names"] == ["global", "startupWarnings"]
    assert admin.command("getLog", "global")["log"] == []
    assert admin.command("refreshSessions", [])["ok"] == 1.0
    assert admin.command("killAllSessions", [])["ok"] == 1.0


def test_repl_set_get_status(rs3: ReplicaSet, clients: Any) -> None:
    status = clients(rs3.uri).admin.command("replSetGetStatus")
    assert status["set"] == "rs0" and status["myState"] == 1
    assert [m["name"] for m in status["members"]] == rs3.members
    states = {m["name"]: m["stateStr"] for m in status["members"]}
    assert states == {m: ("PRIMARY" if m == rs3.primary else "SECONDARY") for m in rs3.members}
    assert [m.get("self", False) for m in status["members"]] == [
        m == rs3.primary for m in rs3.members
    ]


def test_cluster_time_gossip_advances_the_clock(rs3: ReplicaSet, clients: Any) -> None:
    client = clients(rs3.uri)
    future = Timestamp(rs3.deployment.clock.current().time + 1000, 7)
    with client.start_session() as session:
        session.advance_cluster_time(
            {"clusterTime": future, "signature": {"hash": b"\x00" * 20, "keyId": 0}}
        )
        reply = client.admin.command("ping", session=session)
    assert reply["$clusterTime"]["clusterTime"] >= future
    assert rs3.deployment.clock.current() >= future


# -- discovery and roles --------------------------------------------------------------------------


def test_three_member_discovery(rs3: ReplicaSet, clients: Any) -> None:
    client = clients(rs3.uri)
    client.admin.command("ping")
    wait_until(
        lambda: (
            len(client.topology_description.server_descriptions()) == 3
            and all(
                sd.server_type_name != "Unknown"
                for sd in client.topology_description.server_descriptions().values()
            )
        )
    )
    topology = client.topology_description
    assert topology.topology_type_name == "ReplicaSetWithPrimary"
    kinds = sorted(sd.server_type_name for sd in topology.server_descriptions().values())
    assert kinds == ["RSPrimary", "RSSecondary", "RSSecondary"]
    host, port = rs3.primary.rsplit(":", 1)
    assert client.primary == (host, int(port))


def test_admin_commands_run_on_a_secondary(rs3: ReplicaSet, clients: Any) -> None:
    member = secondaries(rs3)[0]
    admin = clients(f"mongodb://{member}/?directConnection=true").admin
    assert admin.command("ping")["ok"] == 1.0
    assert admin.command("serverStatus")["repl"]["secondary"] is True
    with pytest.raises(NotPrimaryError) as exc:
        admin.command("replSetStepDown", 10)
    assert exc.value.details is not None and exc.value.details["code"] == 10107


def test_writes_on_a_secondary_fail_with_not_writable_primary(rs3: ReplicaSet) -> None:
    member = secondaries(rs3)[0]
    reply = raw_command(member, {"create": "c", "$db": "db"})
    assert (reply["ok"], reply["code"], reply["codeName"]) == (0.0, 10107, "NotWritablePrimary")
    assert reply["errmsg"] == "not primary"
    assert list(reply)[4:] == ["topologyVersion", "$clusterTime", "operationTime"]
    # even with a secondaryOk read preference
    body = {"create": "c", "$db": "db", "$readPreference": {"mode": "secondaryPreferred"}}
    assert raw_command(member, body)["code"] == 10107


def test_reads_on_a_secondary_need_a_secondary_ok_read_preference(rs3: ReplicaSet) -> None:
    member = secondaries(rs3)[0]
    reply = raw_command(member, {"listCollections": 1, "$db": "db"})
    assert (reply["code"], reply["codeName"]) == (13435, "NotPrimaryNoSecondaryOk")
    assert reply["errmsg"] == "not primary and secondaryOk=false"
    for mode in ("secondaryPreferred", "secondary", "primaryPreferred", "nearest"):
        body = {"listCollections": 1, "$db": "db", "$readPreference": {"mode": mode}}
        assert raw_command(member, body)["ok"] == 1.0
    assert raw_command(member, {"ping": 1, "$db": "db"})["ok"] == 1.0  # allowed everywhere


class _Addresses(monitoring.CommandListener):
    def __init__(self) -> None:
        self.by_command: list[tuple[str, str]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        host, port = event.connection_id
        self.by_command.append((event.command_name, f"{host}:{port}"))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_secondary_preferred_reads_are_served_by_a_secondary(rs3: ReplicaSet, clients: Any) -> None:
    listener = _Addresses()
    client = clients(rs3.uri, event_listeners=[listener])
    client.admin.command("ping")
    wait_until(lambda: len(client.secondaries) == 2)
    client.db.coll.insert_one({"_id": "seen-by-secondaries"})
    coll = client.db.get_collection("coll", read_preference=ReadPreference.SECONDARY_PREFERRED)
    assert coll.find_one({"_id": "seen-by-secondaries"}) == {"_id": "seen-by-secondaries"}
    served = [addr for name, addr in listener.by_command if name == "find"]
    assert served and served[0] in secondaries(rs3)


class _Heartbeats(monitoring.ServerHeartbeatListener):
    def __init__(self) -> None:
        self.awaited: list[bool] = []

    def started(self, event: monitoring.ServerHeartbeatStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.ServerHeartbeatSucceededEvent) -> None:
        self.awaited.append(event.awaited)

    def failed(self, event: monitoring.ServerHeartbeatFailedEvent) -> None:
        pass


def _primary_seen(client: Client) -> str | None:
    address = client.topology_description.server_descriptions()
    for (host, port), sd in address.items():
        if sd.server_type_name == "RSPrimary":
            return f"{host}:{port}"
    return None


def test_streaming_hello_wakes_at_once_on_step_down(start_rs: Any, clients: Any) -> None:
    rs = start_rs("8.0", members=2)
    beats = _Heartbeats()
    # heartbeats every 60 s: only the awaitable (streaming) hello can notice a change quickly
    client = clients(rs.uri, heartbeatFrequencyMS=60_000, event_listeners=[beats])
    client.admin.command("ping")
    wait_until(lambda: len(beats.awaited) >= 2)  # both initial (polling) handshakes
    old = rs.primary
    time.sleep(0.5)  # let both monitors enter their awaitable hello
    new = rs.step_down(close_connections=False)
    assert new != old and rs.primary == new
    took = wait_until(lambda: _primary_seen(client) == new, timeout=5)
    assert took < 2.0
    assert True in beats.awaited
    status = client.admin.command("replSetGetStatus")
    assert [m["name"] for m in status["members"] if m.get("self")] == [new]


def test_repl_set_step_down_command(start_rs: Any, clients: Any) -> None:
    rs = start_rs("8.0", members=2)
    client = clients(rs.uri, heartbeatFrequencyMS=500)
    old, term = rs.primary, rs.deployment.term
    assert client.admin.command("replSetStepDown", 60)["ok"] == 1.0
    assert rs.primary != old and rs.deployment.term == term + 1
    wait_until(lambda: _primary_seen(client) == rs.primary)


def test_single_member_step_down_needs_force(start_rs: Any, clients: Any) -> None:
    rs = start_rs("8.0")
    client = clients(rs.uri, heartbeatFrequencyMS=500)
    with pytest.raises(OperationFailure) as exc:
        client.admin.command("replSetStepDown", 60)
    assert exc.value.code == 262
    term = rs.deployment.term
    client.admin.command("replSetStepDown", 60, force=True)
    assert rs.deployment.term == term + 1 and rs.primary == rs.members[0]


def test_step_down_bumps_term_election_id_and_topology_version(start_rs: Any, clients: Any) -> None:
    rs = start_rs("8.0", members=3)
    old = rs.primary
    before = {m.name: (m.process_id, m.topology_counter) for m in rs.deployment.members}
    new = rs.step_down(close_connections=True)
    assert new == rs.members[1] and rs.deployment.term == 2
    for m in rs.deployment.members:
        if m.name == old:  # restarted: new processId, counter from 0
            assert m.process_id != before[m.name][0] and m.topology_counter == 0
        else:
            assert m.topology_counter == before[m.name][1] + 1
    hello = clients(rs.uri).admin.command("hello")
    assert hello["me"] == new and str(hello["electionId"]) == "7fffffff0000000000000002"
    ops = [e.o.get("msg") for e in rs.deployment.oplog.read(rs.deployment.oplog.first_seq)]
    assert ops[-1] == "new primary"


def test_periodic_noop_is_written_while_idle(start_rs: Any) -> None:
    rs = start_rs("8.0", noop_interval=0.1)
    oplog = rs.deployment.oplog
    wait_until(lambda: len(oplog) >= 3, timeout=3)
    entries = oplog.read(oplog.first_seq)
    assert [e.o for e in entries[1:3]] == [{"msg": "periodic noop"}] * 2
    assert all(e.op == "n" for e in entries)


def test_concurrent_clients(rs3: ReplicaSet, clients: Any) -> None:
    client = clients(rs3.uri, maxPoolSize=8)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(50):
                client.admin.command("ping")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []


def test_command_line_serves_until_sigterm() -> None:
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "changestream.testing", "serve", "--port", "0"),
            *("--members", "2", "--networkMessageCompressors", "noop,zlib"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        uri = proc.stdout.readline().strip()
        assert uri.startswith("mongodb://127.0.0.1:") and uri.endswith("/?replicaSet=rs0")
        with MongoClient(uri, serverSelectionTimeoutMS=5000) as client:
            assert client.admin.command("ping")["ok"] == 1.0
            offer = client.admin.command("hello", compression=["zstd", "zlib", "noop"])
            assert offer["compression"] == ["zlib", "noop"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_command_line_stops_on_ctrl_c_when_started_with_sigint_ignored() -> None:
    """A background job (``serve &`` in a script, CI) inherits SIGINT as ignored; Ctrl-C still stops it."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    ignore_then_serve = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "os.execv(sys.executable, [sys.executable, '-m', 'changestream.testing', 'serve', "
        "'--port', '0'])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", ignore_then_serve],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        uri = proc.stdout.readline().strip()
        with MongoClient(uri, serverSelectionTimeoutMS=10000) as client:
            assert client.admin.command("ping")["ok"] == 1.0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
