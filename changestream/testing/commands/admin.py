"""Handshake, diagnostics, session and replication commands (hello, buildInfo, ...).

Role changes (:func:`~changestream.testing.core.topology.elect_next`) and the
condition awaitable hellos wait on belong to the deployment
(:mod:`changestream.testing.core.topology`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from ..core.codec import MAX_MESSAGE_SIZE
from ..core.context import CLIENT_CHECK_SECONDS, CommandContext, ConnectionInfo
from ..core.errors import CommandError
from ..core.topology import elect_next, topology_version
from ..storage import type_name
from ..storage.sessions import abort_all_sessions, abort_session, session_uuid
from .auth import sasl_start
from .common import GENERIC_ARGS
from .spec import command

if TYPE_CHECKING:
    from ..storage.deployment import Deployment, Member

MAX_BSON_OBJECT_SIZE = 16 * 1024 * 1024
MAX_WRITE_BATCH_SIZE = 100_000
LOGICAL_SESSION_TIMEOUT_MINUTES = 30


def await_topology_change(
    member: Member, client_tv: Any, max_await_ms: Any, conn: ConnectionInfo
) -> None:
    """Block until ``member``'s topologyVersion differs from ``client_tv`` or time runs out.

    Ends with :class:`~changestream.testing.core.errors.ClientDisconnected` when the
    connection goes first (mongod marks hello "kill on client disconnect").
    """
    if not isinstance(client_tv, dict) or not isinstance(client_tv.get("processId"), ObjectId):
        raise CommandError(
            40414, "BSON field 'topologyVersion.processId' is missing but a required field"
        )
    counter = client_tv.get("counter")
    if not isinstance(counter, int):
        raise CommandError(
            40414, "BSON field 'topologyVersion.counter' is missing but a required field"
        )
    if (
        not isinstance(max_await_ms, (int, float))
        or isinstance(max_await_ms, bool)
        or max_await_ms < 0
    ):
        raise CommandError(31373, "maxAwaitTimeMS must be a non-negative integer")
    if client_tv["processId"] == member.process_id and counter > member.topology_counter:
        raise CommandError(
            31382,
            "Topology version counter in request is greater than the server's. "
            f"Request: {counter}, Server: {member.topology_counter}",
        )
    deadline = time.monotonic() + max_await_ms / 1000
    changed = member.deployment.topology_changed
    with changed:
        while (
            member.up
            and client_tv["processId"] == member.process_id
            and counter == member.topology_counter
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            changed.wait(min(left, CLIENT_CHECK_SECONDS))
            _check_quiesce(member)
            conn.check_connected()


def _check_quiesce(member: Member) -> None:
    """ShutdownInProgress for a hello while the member shuts down in quiesce mode (5.0+).

    The simulator's quiesce period is empty: the remaining time is always 0.
    """
    if member.quiescing:
        raise CommandError(
            91,
            "The server is in quiesce mode and will shut down",
            extra={"remainingQuiesceTimeMillis": 0},
        )


# -- hello -------------------------------------------------------------------------------------


def _wall(ts: Timestamp) -> datetime:
    return datetime.fromtimestamp(ts.time, tz=timezone.utc)


def _op_time(deployment: Deployment) -> dict[str, Any]:
    return {"ts": deployment.last_applied(), "t": Int64(deployment.term)}


@command("isMaster", "ismaster", locks=False, any_member=True, handshake=True, auth=False)
@command("hello", locks=False, any_member=True, handshake=True, auth=False)
def hello(ctx: CommandContext) -> dict[str, Any]:
    """The handshake and SDAM monitoring reply, awaitable on 4.4+ (``replication_info.cpp``).

    ``isMaster`` is a separate command in mongod (failCommand tells them
    apart) that answers ``ismaster`` instead of ``isWritablePrimary``.
    """
    body, conn, deployment, member = ctx.body, ctx.connection, ctx.deployment, ctx.member
    profile = deployment.profile
    hello_ok = body.get("helloOk")
    if hello_ok is not None and not isinstance(hello_ok, bool):
        raise CommandError(
            14,
            f"BSON field '{ctx.name}.helloOk' is the wrong type '{type(hello_ok).__name__}', "
            "expected type 'bool'",
        )
    offered = compression_offer(ctx)  # the client metadata: taken by the dispatcher
    _check_quiesce(member)
    if ("topologyVersion" in body) != ("maxAwaitTimeMS" in body):
        raise CommandError(
            31368,
            "A request with a 'topologyVersion' must include 'maxAwaitTimeMS'"
            if "topologyVersion" in body
            else "A request with 'maxAwaitTimeMS' must include a 'topologyVersion'",
        )
    if "topologyVersion" in body and profile.topology_version:
        await_topology_change(member, body["topologyVersion"], body["maxAwaitTimeMS"], conn)

    writable_key = "ismaster" if ctx.name in ("isMaster", "ismaster") else "isWritablePrimary"
    reply: dict[str, Any] = {}
    if hello_ok is not None:
        reply["helloOk"] = True
    if deployment.standalone:
        reply[writable_key] = True
        if profile.topology_version:
            reply["topologyVersion"] = topology_version(member)
    else:
        if profile.topology_version:
            reply["topologyVersion"] = topology_version(member)
        primary = deployment.primary
        is_primary = primary is member
        reply["hosts"] = [m.name for m in deployment.members]
        reply["setName"] = deployment.set_name
        reply["setVersion"] = deployment.set_version
        reply[writable_key] = is_primary
        reply["secondary"] = not is_primary
        if primary is not None:
            reply["primary"] = primary.name
        reply["me"] = member.name
        if is_primary:
            reply["electionId"] = ObjectId(f"7fffffff{deployment.term:016x}")
        op_time = _op_time(deployment)
        date = _wall(op_time["ts"])
        reply["lastWrite"] = {
            "opTime": op_time,
            "lastWriteDate": date,
            "majorityOpTime": dict(op_time),
            "majorityWriteDate": date,
        }
    reply["maxBsonObjectSize"] = MAX_BSON_OBJECT_SIZE
    reply["maxMessageSizeBytes"] = MAX_MESSAGE_SIZE
    reply["maxWriteBatchSize"] = MAX_WRITE_BATCH_SIZE
    reply["localTime"] = deployment.clock.wall()
    reply["logicalSessionTimeoutMinutes"] = LOGICAL_SESSION_TIMEOUT_MINUTES
    reply["connectionId"] = conn.id
    reply["minWireVersion"] = 0
    reply["maxWireVersion"] = profile.max_wire_version
    reply["readOnly"] = False
    if offered is not None:
        conn.compressors = member.compressors.negotiate(offered)
    if conn.compressors:
        reply["compression"] = list(conn.compressors)
    reply.update(auth_fields(ctx))
    return reply


def auth_fields(ctx: CommandContext) -> dict[str, Any]:
    """``saslSupportedMechs`` (the user's mechanisms, absent for no such user) and 4.4+'s
    ``speculativeAuthenticate`` (a ``saslStart`` run with the hello; absent when it fails)."""
    out: dict[str, Any] = {}
    asked = ctx.body.get("saslSupportedMechs")
    if asked is not None:
        if not isinstance(asked, str) or "." not in asked:
            raise CommandError(2, "UserName must contain a '.' separated database.user pair")
        db, _, user = asked.partition(".")
        mechanisms = ctx.deployment.users.mechanisms(db, user)
        if mechanisms is not None:
            out["saslSupportedMechs"] = mechanisms
    speculative = ctx.body.get("speculativeAuthenticate")
    if (
        isinstance(speculative, dict)
        and "saslStart" in speculative
        and isinstance(speculative.get("db"), str)
        and ctx.deployment.profile.major_minor >= (4, 4)
    ):
        with contextlib.suppress(CommandError):
            out["speculativeAuthenticate"] = sasl_start(ctx, speculative, speculative["db"])
    return out


def take_client_metadata(body: dict[str, Any], conn: ConnectionInfo) -> None:
    """The handshake's ``client`` document, accepted once per connection (mongod and mongos)."""
    if "client" not in body:
        return
    if conn.client_metadata is not None:
        raise CommandError(186, "The client metadata document may only be sent in the first hello")
    metadata = body["client"]
    if not isinstance(metadata, dict):
        raise CommandError(14, "'client' field must be an object")
    app = metadata.get("application")
    conn.client_metadata = metadata
    conn.app_name = app.get("name") if isinstance(app, dict) else None


def compression_offer(ctx: CommandContext) -> list[str] | None:
    """The ``compression`` list of a hello (IDL-checked), or None when it has none.

    ``serverNegotiate``: a hello with the field renegotiates the connection's
    compressors; one without it just reports what was negotiated before.
    """
    if "compression" not in ctx.body:
        return None
    offered = ctx.body["compression"]
    if not isinstance(offered, list):
        raise CommandError(
            14,
            f"BSON field '{ctx.name}.compression' is the wrong type "
            f"'{type_name(offered)}', expected type 'array'",
        )
    for index, name in enumerate(offered):
        if not isinstance(name, str):
            raise CommandError(
                14,
                f"BSON field '{ctx.name}.compression.{index}' is the wrong type "
                f"'{type_name(name)}', expected type 'string'",
            )
    return offered


# -- build and server information ------------------------------------------------------------


@command("buildInfo", "buildinfo", locks=False, any_member=True, auth=False)
def build_info(ctx: CommandContext) -> dict[str, Any]:
    profile = ctx.deployment.profile
    return {
        "version": profile.version,
        "gitVersion": "0" * 40,
        "modules": [],
        "allocator": "tcmalloc",
        "javascriptEngine": "mozjs",
        "sysInfo": "deprecated",
        "versionArray": profile.version_array,
        "bits": 64,
        "debug": False,
        "maxBsonObjectSize": MAX_BSON_OBJECT_SIZE,
        "storageEngines": ["devnull", "wiredTiger"],
    }


@command("ping", locks=False, any_member=True, auth=False)
def ping(ctx: CommandContext) -> dict[str, Any]:
    return {}


def _parameters(deployment: Deployment) -> dict[str, Any]:
    return {
        "authenticationMechanisms": ["SCRAM-SHA-1", "SCRAM-SHA-256"],
        "enableTestCommands": True,
        "featureCompatibilityVersion": {"version": deployment.fcv},
        "logLevel": 0,
        "maxTransactionLockRequestTimeoutMillis": 5,
        "minSnapshotHistoryWindowInSeconds": deployment.history.window_seconds,
        "notablescan": False,
        "periodicNoopIntervalSecs": 10,
        "quiet": False,
        "requireApiVersion": False,
        "transactionLifetimeLimitSeconds": 60,
    }


@command("getParameter", admin_only=True, locks=False, any_member=True)
def get_parameter(ctx: CommandContext) -> dict[str, Any]:
    params = _parameters(ctx.deployment)
    if ctx.target == "*":
        return params
    found = {name: params[name] for name in ctx.body if name in params}
    if not found:
        raise CommandError(72, "no option found to get")
    return found


def _set_snapshot_window(deployment: Deployment, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise CommandError(
            2, f"Invalid value for minSnapshotHistoryWindowInSeconds: {value!r} (an integer >= 0)"
        )
    if value < 0:
        raise CommandError(
            2,
            f'Bad value for parameter "minSnapshotHistoryWindowInSeconds": {int(value)} is '
            "not greater than or equal to 0",
        )
    old = deployment.history.window_seconds
    deployment.history.window_seconds = int(value)
    return old


_SETTABLE = frozenset({"minSnapshotHistoryWindowInSeconds"})


@command("setParameter", admin_only=True, locks=True, any_member=True)
def set_parameter(ctx: CommandContext) -> dict[str, Any]:
    """Only the parameters the simulator implements; others fail as unknown ones do."""
    names = [n for n in ctx.body if n != "setParameter" and n not in GENERIC_ARGS]
    if not names:
        raise CommandError(72, "no option found to set, use help:true to see options ")
    unknown = [n for n in names if n not in _SETTABLE]
    if unknown:
        raise CommandError(
            72,
            f"attempted to set unrecognized parameter [{unknown[0]}], use help:true to see options ",
        )
    reply: dict[str, Any] = {}
    for name in names:
        reply["was"] = _set_snapshot_window(ctx.deployment, ctx.body[name])
    return reply


def _repl_info(deployment: Deployment, member: Member) -> dict[str, Any]:
    primary = deployment.primary
    return {
        "hosts": [m.name for m in deployment.members],
        "setName": deployment.set_name,
        "setVersion": deployment.set_version,
        "isWritablePrimary": primary is member,
        "secondary": primary is not member,
        "primary": primary.name if primary is not None else None,
        "me": member.name,
    }


@command("serverStatus", locks=False, any_member=True)
def server_status(ctx: CommandContext) -> dict[str, Any]:
    deployment, member = ctx.deployment, ctx.member
    server = member.server
    current = server.connection_count if server is not None else 0
    uptime = max(0.0, time.time() - deployment.started_at)
    network: dict[str, Any] = {}
    if server is not None:
        counters = server.network
        network = {
            "bytesIn": Int64(counters.bytes_in),
            "bytesOut": Int64(counters.bytes_out),
            "physicalBytesIn": Int64(counters.physical_in),
            "physicalBytesOut": Int64(counters.physical_out),
            "numRequests": Int64(counters.requests),
        }
    network["compression"] = member.compressors.stats()
    reply: dict[str, Any] = {
        "host": member.name,
        "version": deployment.profile.version,
        "process": "mongod",
        "pid": Int64(os.getpid()),
        "uptime": float(int(uptime)),
        "uptimeMillis": Int64(int(uptime * 1000)),
        "uptimeEstimate": Int64(int(uptime)),
        "localTime": deployment.clock.wall(),
        "connections": {
            "current": current,
            "available": 838_860 - current,
            "totalCreated": server.total_created if server is not None else 0,
            "active": 1,
        },
        "network": network,
    }
    change_streams = deployment.cs_metrics.document()
    if change_streams is not None:
        reply["metrics"] = {"changeStreams": change_streams}
    if not deployment.standalone:
        reply["repl"] = _repl_info(deployment, member)
    reply["storageEngine"] = {
        "name": "wiredTiger",
        "supportsCommittedReads": True,
        "readOnly": False,
        "persistent": True,
    }
    return reply


@command("hostInfo", locks=False, any_member=True)
def host_info(ctx: CommandContext) -> dict[str, Any]:
    return {
        "system": {
            "currentTime": ctx.deployment.clock.wall(),
            "hostname": socket.gethostname(),
            "cpuAddrSize": 64,
            "numCores": os.cpu_count() or 1,
            "cpuArch": platform.machine(),
            "numaEnabled": False,
        },
        "os": {
            "type": platform.system(),
            "name": platform.platform(),
            "version": platform.release(),
        },
        "extra": {},
    }


@command("connectionStatus", locks=False, any_member=True, auth=False)
def connection_status(ctx: CommandContext) -> dict[str, Any]:
    user = ctx.connection.user
    auth: dict[str, Any] = {
        "authenticatedUsers": [] if user is None else [{"user": user[0], "db": user[1]}],
        "authenticatedUserRoles": [] if user is None else [{"role": "root", "db": "admin"}],
    }
    if ctx.body.get("showPrivileges"):
        auth["authenticatedUserPrivileges"] = []
    return {"authInfo": auth}


@command("whatsmyuri", locks=False, any_member=True, auth=False)
def whats_my_uri(ctx: CommandContext) -> dict[str, Any]:
    host, port = ctx.connection.peer[:2]
    return {"you": f"{host}:{port}"}


@command("getCmdLineOpts", admin_only=True, locks=False, any_member=True)
def get_cmd_line_opts(ctx: CommandContext) -> dict[str, Any]:
    member, deployment = ctx.member, ctx.deployment
    argv = ["mongod", "--bind_ip", member.host, "--port", str(member.port)]
    parsed: dict[str, Any] = {"net": {"bindIp": member.host, "port": member.port}}
    if not deployment.standalone:
        argv += ["--replSet", str(deployment.set_name)]
        parsed["replication"] = {"replSet": deployment.set_name}
    return {"argv": argv, "parsed": parsed}


_LOGS = ("global", "startupWarnings")


@command("getLog", admin_only=True, locks=False, any_member=True)
def get_log(ctx: CommandContext) -> dict[str, Any]:
    name = ctx.target
    if name == "*":
        return {"names": list(_LOGS)}
    if name not in _LOGS:
        raise CommandError(8, f"no RamLog named: {name}")
    return {"totalLinesWritten": 0, "log": []}


# -- sessions ------------------------------------------------------------------------------------


@command("endSessions", locks=False, any_member=True)
def end_sessions(ctx: CommandContext) -> dict[str, Any]:
    """Accepted, and nothing ends now: mongod only marks the sessions as ending and
    kills their cursors at the next session-cache refresh (``logicalSessionRefreshMillis``,
    5 minutes by default); their transactions expire after ``transactionLifetimeLimitSeconds``.
    """
    if not isinstance(ctx.target, list):
        raise CommandError(
            14, "BSON field 'endSessions.endSessions' is the wrong type, expected type 'array'"
        )
    return {}


@command("refreshSessions", locks=False, any_member=True)
def refresh_sessions(ctx: CommandContext) -> dict[str, Any]:
    return {}


def _kill_sessions(ctx: CommandContext, lsids: list[dict[str, Any]] | None) -> None:
    """``killSessionsLocal``: abort the sessions' open transactions, kill their cursors here.

    ``lsids`` None means every session (``killAllSessions: []``, or ``killSessions: []``
    without auth).
    """
    if lsids is None:
        abort_all_sessions(ctx)
        killed = ctx.deployment.cursors.kill_sessions(ctx.member.name, None)
    else:
        for lsid in lsids:
            abort_session(ctx, lsid)
        ids = {session_uuid(lsid).bytes for lsid in lsids}
        killed = ctx.deployment.cursors.kill_sessions(ctx.member.name, ids)
    if killed:
        ctx.deployment.oplog.notify()


@command("killSessions", any_member=True)
def kill_sessions(ctx: CommandContext) -> dict[str, Any]:
    """Kill the listed sessions (``[]``: all of them, as auth is disabled)."""
    lsids = ctx.target
    if not isinstance(lsids, list):
        raise CommandError(
            14,
            f"BSON field 'KillSessionsCmdFromClient.killSessions' is the wrong type "
            f"'{type_name(lsids)}', expected type 'array'",
        )
    for lsid in lsids:
        if not isinstance(lsid, dict) or "id" not in lsid:
            raise CommandError(
                40414,
                "BSON field 'KillSessionsCmdFromClient.killSessions.id' is missing but a "
                "required field",
            )
        session_uuid(lsid)  # the id must be a UUID
    _kill_sessions(ctx, lsids or None)
    return {}


@command("killAllSessions", any_member=True)
def kill_all_sessions(ctx: CommandContext) -> dict[str, Any]:
    """``[]`` kills every session; a list of ``{user, db}`` kills those users' sessions,
    which (auth being disabled, every session belongs to no user) are none."""
    users = ctx.target
    if not isinstance(users, list):
        raise CommandError(
            14,
            "BSON field 'killAllSessions.killAllSessions' is the wrong type, expected type 'array'",
        )
    if not users:
        _kill_sessions(ctx, None)
    return {}


# -- replication -----------------------------------------------------------------------------


@command("replSetGetStatus", admin_only=True, any_member=True, standalone_ok=False)
def repl_set_get_status(ctx: CommandContext) -> dict[str, Any]:
    deployment, me = ctx.deployment, ctx.member
    op_time = _op_time(deployment)
    date = _wall(op_time["ts"])
    uptime = int(max(0.0, time.time() - deployment.started_at))
    members = []
    for m in deployment.members:
        primary = m is deployment.primary
        entry: dict[str, Any] = {
            "_id": m.index,
            "name": m.name,
            "health": 1.0,
            "state": 1 if primary else 2,
            "stateStr": "PRIMARY" if primary else "SECONDARY",
            "uptime": uptime,
            "optime": dict(op_time),
            "optimeDate": date,
            "syncSourceHost": ""
            if primary
            else (deployment.primary.name if deployment.primary else ""),
            "syncSourceId": -1
            if primary or deployment.primary is None
            else deployment.primary.index,
            "infoMessage": "",
            "configVersion": deployment.set_version,
            "configTerm": deployment.term,
        }
        if m is me:
            entry["self"] = True
        members.append(entry)
    votes = len(deployment.members)
    majority = votes // 2 + 1
    return {
        "set": deployment.set_name,
        "date": deployment.clock.wall(),
        "myState": 1 if me.is_primary else 2,
        "term": Int64(deployment.term),
        "heartbeatIntervalMillis": Int64(2000),
        "majorityVoteCount": majority,
        "writeMajorityCount": majority,
        "votingMembersCount": votes,
        "writableVotingMembersCount": votes,
        "optimes": {
            "lastCommittedOpTime": dict(op_time),
            "lastCommittedWallTime": date,
            "appliedOpTime": dict(op_time),
            "durableOpTime": dict(op_time),
            "lastAppliedWallTime": date,
            "lastDurableWallTime": date,
        },
        "members": members,
    }


@command("replSetStepDown", admin_only=True, any_member=True, standalone_ok=False)
def repl_set_step_down(ctx: CommandContext) -> dict[str, Any]:
    """4.2+ semantics: connections stay open; the next member becomes primary at once."""
    secs = ctx.target
    if not isinstance(secs, (int, float)) or isinstance(secs, bool):
        raise CommandError(14, "stepdown period must be a number")
    catch_up = ctx.body.get("secondaryCatchUpPeriodSecs", 10)
    if isinstance(catch_up, (int, float)) and catch_up > secs:
        raise CommandError(2, "stepdown period must be longer than secondaryCatchUpPeriodSecs")
    if not ctx.member.is_primary:
        raise CommandError(10107, "not primary so can't step down")
    if sum(m.up for m in ctx.deployment.members) == 1 and not ctx.body.get("force"):
        raise CommandError(
            262,
            f"No electable secondaries caught up as of {ctx.deployment.clock.wall().isoformat()}. "
            "Please use the replSetStepDown command with the argument {force: true} to force "
            "node to step down.",
        )
    elect_next(ctx.deployment)
    return {}
