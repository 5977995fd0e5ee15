"""Turn one decoded request into one reply document, as mongod's command path does.

Order (``service_entry_point_common.cpp``): find the command, reject it for
the wrong database or opcode, gossip ``$clusterTime``, evaluate failCommand,
check the member's role, run the handler (holding ``deployment.lock`` unless
the command waits), then add ``ok``, labels, ``$clusterTime`` and
``operationTime``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .. import commands
from ..commands import CommandContext, CommandSpec, ConnectionInfo
from ..commands.admin import take_client_metadata
from ..core.errors import RETRIABLE_CODES, CloseConnection, CommandError, change_stream_labels
from ..core.failpoints import CommandTarget
from ..core.topology import topology_version
from .wire import OP_QUERY, OP_QUERY_SECONDARY_OK, Request

if TYPE_CHECKING:
    from ..storage.deployment import Deployment, Member

log = logging.getLogger(__name__)

_SHUTDOWN_CODES = frozenset({91, 11600})
_TRANSIENT_TXN_CODES = frozenset({24, 112, 239, 246, 267})
"""LockTimeout, WriteConflict, snapshot errors, PreparedTransactionInProgress."""
NOT_PRIMARY_CODES = frozenset({189, 10107, 11602, 13435, 13436})
"""mongod's NotPrimaryError category: their replies always carry ``topologyVersion`` (4.4+).

The ShutdownError category (91, 11600) carries it only while the member really shuts
down (``appendErrorLabelsAndTopologyVersion`` in mongod's
``src/mongo/db/service_entry_point_common.cpp``: ``isNotPrimaryError || (isShutdownError
&& replCoord->inQuiesceMode())``), so one injected by ``failCommand`` has none and drivers
take it as current (PyMongo clears its pool on it)."""
STATE_CHANGE_CODES = NOT_PRIMARY_CODES | _SHUTDOWN_CODES
"""NotPrimary and shutdown errors: the member can no longer serve the operation."""
_WRITE_CONCERN_COMMANDS = frozenset({"commitTransaction", "abortTransaction"})
_TXN_END_COMMANDS = _WRITE_CONCERN_COMMANDS
_HELLO_COMMANDS = frozenset({"hello", "isMaster"})
_MAX_INT32 = 2**31 - 1
_READ_ONLY_COMMANDS = frozenset(
    {
        "hello",
        "isMaster",
        "ping",
        "buildInfo",
        "serverStatus",
        "hostInfo",
        "connectionStatus",
        "getParameter",
        "find",
        "getMore",
        "count",
        "distinct",
        "listCollections",
        "listIndexes",
        "listDatabases",
    }
)
"""Commands without side effects: blocked by failCommand, they end when their client leaves."""


def _parse_max_time_ms(value: Any) -> int:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CommandError(2, "maxTimeMS must be a number")
    if isinstance(value, float) and not value.is_integer():
        raise CommandError(2, "maxTimeMS has a fractional component")
    if not 0 <= value <= _MAX_INT32:
        raise CommandError(2, f"maxTimeMS is out of range [0, {_MAX_INT32}]")
    return int(value)


def _namespace(db: str, spec: CommandSpec, body: dict[str, Any], target: Any) -> str:
    """The namespace failCommand's ``namespace`` filter compares with."""
    if spec.name == "getMore":
        target = body.get("collection")
    if isinstance(target, str) and target:
        return f"{db}.{target}"
    return f"{db}.$cmd.aggregate" if spec.name == "aggregate" else f"{db}.$cmd"


def _read_only(spec: CommandSpec, body: dict[str, Any]) -> bool:
    """Whether ending the command early changes nothing anyone can see ($out/$merge write)."""
    if spec.name == "aggregate":
        pipeline = body.get("pipeline")
        return isinstance(pipeline, list) and not any(
            isinstance(stage, dict) and ("$out" in stage or "$merge" in stage) for stage in pipeline
        )
    return spec.name in _READ_ONLY_COMMANDS


class Dispatcher:
    """Runs commands for one member."""

    def __init__(self, deployment: Deployment, member: Member) -> None:
        self.deployment = deployment
        self.member = member
        self.registry = commands.REGISTRY
        aliases: dict[str, set[str]] = {}
        for name, spec in self.registry.items():
            aliases.setdefault(spec.name, set()).add(name)
        self._aliases = {name: frozenset(names) for name, names in aliases.items()}

    # -- the request path --------------------------------------------------------------------
    def run(self, conn: ConnectionInfo, request: Request) -> dict[str, Any]:
        """Execute ``request``; return the reply document (raises :class:`CloseConnection`)."""
        body = request.body
        name = next(iter(body), "")
        ctx: CommandContext | None = None
        try:
            db = request.db if request.op_code == OP_QUERY else body.get("$db")
            if not isinstance(db, str) or not db:
                raise CommandError(40571, "OP_MSG requests require a $db argument")
            spec = self.registry.get(name)
            if spec is None or (
                spec.requires is not None and not getattr(self.deployment.profile, spec.requires)
            ):
                raise CommandError(59, f"no such command: '{name}'")
            if (
                request.op_code == OP_QUERY
                and self.deployment.profile.rejects_op_query_commands
                and not spec.handshake
            ):
                raise CommandError(
                    352,
                    f"Unsupported OP_QUERY command: {name}. The client driver may require an "
                    "upgrade. For more details see "
                    "https://dochub.mongodb.org/core/legacy-opcode-removal",
                )
            ctx = self._context(conn, db, name, body)
            conn.check_interrupted()  # the member is shutting down
            if spec.admin_only and db != "admin":
                raise CommandError(13, f"{name} may only be run against the admin database.")
            if spec.auth and conn.user is None and self.deployment.users.enabled:
                command = "Command" if self.deployment.profile.major_minor >= (8, 0) else "command"
                raise CommandError(13, f"{command} {spec.name} requires authentication")
            self._gossip_in(conn, body)
            if self.deployment.standalone:
                if not spec.standalone_ok:
                    raise CommandError(76, "not running with --replSet")
                if ctx.txn_number is not None:
                    raise CommandError(
                        20,
                        "Transaction numbers are only allowed on a replica set member or mongos",
                    )
            names = self._aliases.get(spec.name) or frozenset({spec.name, name})
            if not names.isdisjoint(_HELLO_COMMANDS):
                # mongod preloads a hello's client metadata before failCommand is evaluated
                # (service_entry_point_common.cpp), so ``appName`` matches a new connection's
                # first hello too
                take_client_metadata(body, conn)
            target = CommandTarget(names, _namespace(db, spec, body, body[name]), conn.app_name)
            self._fail_command(target, conn, spec, body)
            if spec.name != "getMore":  # getMore checks its cursor's time limit too
                self.member.failpoints.check_max_time(bool(ctx.max_time_ms))
            secondary_ok = self._secondary_ok_requested(request, ctx)
            if spec.locks:
                with self.deployment.lock:
                    self._check_role(spec, secondary_ok)
                    fields = spec.handler(ctx)
            else:
                self._check_role(spec, secondary_ok)
                fields = spec.handler(ctx)
            if ctx.close_connection:
                raise CloseConnection
            return self._success(ctx, spec, target, fields)
        except CommandError as err:
            if ctx is not None and ctx.close_connection:
                raise CloseConnection from None
            return self.error_reply(ctx, err)
        except CloseConnection:
            raise
        except Exception as exc:
            log.exception("command %r failed unexpectedly", name)
            return self.error_reply(ctx, CommandError(1, f"{type(exc).__name__}: {exc}"))

    def _context(
        self, conn: ConnectionInfo, db: str, name: str, body: dict[str, Any]
    ) -> CommandContext:
        lsid = body.get("lsid")
        txn_number = body.get("txnNumber")
        autocommit = body.get("autocommit")
        read_pref = body.get("$readPreference")
        ctx = CommandContext(
            deployment=self.deployment,
            member=self.member,
            connection=conn,
            db=db,
            name=name,
            body=body,
            lsid=lsid if isinstance(lsid, dict) else None,
            txn_number=int(txn_number) if isinstance(txn_number, int) else None,
            start_transaction=body.get("startTransaction") is True,
            autocommit=autocommit if isinstance(autocommit, bool) else None,
            read_preference=read_pref if isinstance(read_pref, dict) else None,
        )
        if "maxTimeMS" in body:
            ctx.max_time_ms = _parse_max_time_ms(body["maxTimeMS"])
            if ctx.max_time_ms:
                ctx.deadline = time.monotonic() + ctx.max_time_ms / 1000
        return ctx

    def _gossip_in(self, conn: ConnectionInfo, body: dict[str, Any]) -> None:
        """The client's ``$clusterTime``, validated as mongod validates it (after the auth
        check, so an unauthenticated client only gets here for the handshake commands)."""
        if "$clusterTime" in body and not self.deployment.standalone:
            self.deployment.clock.gossip_in(
                body["$clusterTime"],
                auth=self.deployment.users.enabled,
                authenticated=conn.user is not None,
            )

    def _fail_command(
        self, target: CommandTarget, conn: ConnectionInfo, spec: CommandSpec, body: dict[str, Any]
    ) -> None:
        action = self.member.failpoints.fail_command(target)
        if action is None:
            return
        if action.close_connection:
            raise CloseConnection
        if action.block_ms:
            # Closing the connection (failover, stop) always ends the block. A client
            # that leaves ends it only for a command without side effects: a write still
            # happens after the block, as on mongod, and its reply is lost.
            conn.sleep(action.block_ms / 1000, kill_on_disconnect=_read_only(spec, body))
        if action.error is not None:
            raise action.error

    @staticmethod
    def _secondary_ok_requested(request: Request, ctx: CommandContext) -> bool:
        if request.op_code == OP_QUERY and request.flags & OP_QUERY_SECONDARY_OK:
            return True
        mode = (ctx.read_preference or {}).get("mode", "primary")
        return bool(mode != "primary")

    def _check_role(self, spec: CommandSpec, secondary_ok: bool) -> None:
        """NotWritablePrimary / NotPrimaryNoSecondaryOk on a secondary (checked under the lock)."""
        if self.deployment.standalone or self.member.is_primary or spec.any_member:
            return
        if spec.write or not spec.secondary_ok:
            raise CommandError(10107, "not primary")
        if not secondary_ok:
            raise CommandError(13435, "not primary and secondaryOk=false")

    # -- replies ---------------------------------------------------------------------------------
    def _success(
        self, ctx: CommandContext, spec: CommandSpec, target: CommandTarget, fields: dict[str, Any]
    ) -> dict[str, Any]:
        reply = fields
        if ctx.extra_reply:
            reply.update(ctx.extra_reply)
        labels: list[str] = []
        writes = spec.write or spec.name in _WRITE_CONCERN_COMMANDS
        if writes or (spec.name == "aggregate" and "writeConcern" in ctx.body):  # $out/$merge
            injected = self.member.failpoints.write_concern_error(target)
            if injected is not None:
                wce, explicit = injected
                reply["writeConcernError"] = wce
                code = wce.get("code")
                labels = (
                    explicit
                    if explicit is not None
                    else self._labels(ctx, None, code if isinstance(code, int) else None)
                )
            else:
                unsatisfiable = self._unsatisfiable_write_concern(ctx)
                if unsatisfiable is not None:
                    reply["writeConcernError"] = unsatisfiable
        reply["ok"] = 1.0
        if labels:
            reply["errorLabels"] = labels
        self._add_times(ctx, reply)
        return reply

    def _unsatisfiable_write_concern(self, ctx: CommandContext) -> dict[str, Any] | None:
        """UnsatisfiableWriteConcern (100) for ``w`` above the data-bearing members.

        mongod runs the write, then ``waitForWriteConcern`` checks
        ``checkIfWriteConcernCanBeSatisfied`` (``replication_coordinator_impl.cpp``) and
        reports "Not enough data-bearing nodes" as the reply's ``writeConcernError``: for
        every write command, DDL and findAndModify alike.
        """
        concern = ctx.body.get("writeConcern")
        if self.deployment.standalone or not isinstance(concern, dict):
            return None
        w = concern.get("w")
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            return None
        if w <= len(self.deployment.members):
            return None
        return {
            "code": 100,
            "codeName": "UnsatisfiableWriteConcern",
            "errmsg": "Not enough data-bearing nodes",
            "errInfo": {"writeConcern": {**concern, "provenance": "clientSupplied"}},
        }

    def error_reply(self, ctx: CommandContext | None, err: CommandError) -> dict[str, Any]:
        """The ``ok: 0`` reply for ``err`` (``ctx`` None: failed before the command was known)."""
        reply = err.to_reply()
        if err.labels is None and ctx is not None:
            labels = self._labels(ctx, err.code, None)
            if labels:
                reply["errorLabels"] = labels
        if ctx is not None and ctx.change_stream_cursor:
            self.deployment.cs_metrics.stream_failed(err.code)
        if self.deployment.profile.topology_version and (
            err.code in NOT_PRIMARY_CODES
            or (err.code in _SHUTDOWN_CODES and self.member.shutting_down)
        ):
            reply.setdefault("topologyVersion", topology_version(self.member))
        self._add_times(ctx, reply)
        return reply

    def _add_times(self, ctx: CommandContext | None, reply: dict[str, Any]) -> None:
        if self.deployment.standalone:
            return
        reply["$clusterTime"] = self.deployment.clock.cluster_time_doc(
            signed=self.deployment.users.enabled
        )
        op_time = ctx.operation_time if ctx is not None else None
        reply["operationTime"] = op_time or self.deployment.last_applied()

    def _labels(self, ctx: CommandContext, code: int | None, wce_code: int | None) -> list[str]:
        """The labels mongod computes (``error_labels.cpp``), wire version 9 (4.4) and up."""
        profile = self.deployment.profile
        in_txn = ctx.txn_number is not None and ctx.autocommit is not None
        ends_txn = ctx.name in _TXN_END_COMMANDS
        labels: list[str] = []
        if in_txn and code is not None:
            if ends_txn:
                transient = code in _TRANSIENT_TXN_CODES or (code == 251 and wce_code is None)
            else:
                transient = code in _TRANSIENT_TXN_CODES or code in RETRIABLE_CODES or code == 251
            if transient:
                labels.append("TransientTransactionError")
        retryable_write = ctx.txn_number is not None and ctx.autocommit is None
        if (
            profile.max_wire_version >= 9
            and (retryable_write or (in_txn and ends_txn))
            and (code in RETRIABLE_CODES or wce_code in RETRIABLE_CODES or code in _SHUTDOWN_CODES)
        ):
            labels.append("RetryableWriteError")
        if not labels and wce_code is None and code is not None:
            labels = change_stream_labels(
                code, profile, is_change_stream_command=ctx.is_change_stream
            )
        return labels

    # -- exhaust -----------------------------------------------------------------------------
    def exhaust_next(self, body: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any] | None:
        """The request mongod replays for an ``exhaustAllowed`` command, or None to stop.

        An awaitable hello continues with the topologyVersion it just
        reported; a getMore continues while its cursor is open.
        """
        if reply.get("ok") != 1.0:
            return None
        spec = self.registry.get(next(iter(body), ""))
        if spec is None:
            return None
        if spec.name in _HELLO_COMMANDS and "maxAwaitTimeMS" in body and "topologyVersion" in reply:
            return {**body, "topologyVersion": reply["topologyVersion"]}
        if spec.name == "getMore":
            cursor = reply.get("cursor")
            if isinstance(cursor, dict) and cursor.get("id"):
                return body
        return None
