"""Multi-document transactions, retryable writes, and the write sink every writing command uses.

A write command runs inside a :class:`WriteUnit`: outside a transaction its
oplog entries go straight to the oplog; inside one (``lsid`` + ``txnNumber`` +
``autocommit: false``) the writes are applied at once but their entries are
buffered, together with closures that undo them. ``commitTransaction`` then
logs one ``applyOps`` command entry (``admin.$cmd``) whose inner operations
all carry the commit timestamp, which is how mongod makes a transaction's
change events share one ``clusterTime``; ``abortTransaction`` runs the undo
closures and logs nothing.

A retryable write (``lsid`` + ``txnNumber`` without ``autocommit``) remembers,
per statement id, the result of every statement it executed: a retry of the
same ``txnNumber`` returns those results (``retriedStmtIds``) instead of
writing again, as mongod's ``TransactionParticipant`` does, and its oplog
entries carry ``lsid``, ``txnNumber`` and ``stmtId``. Their change events do
not (only events unwound from a transaction's ``applyOps`` do).

Known difference from mongod: there is no snapshot isolation; other clients
see a transaction's writes before it commits.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bson.binary import Binary
from bson.int64 import Int64

from ..core.context import CommandContext
from ..core.errors import CommandError

NO_AUTH_UID: Binary = Binary(hashlib.sha256(b"").digest(), 0)
"""``lsid.uid`` of sessions when auth is disabled: SHA-256 of the empty user name."""

DDL_IN_TRANSACTION = frozenset({"create", "createIndexes"})
"""DDL commands mongod (4.4+) accepts inside a transaction."""


@dataclass(slots=True)
class _PendingOp:
    op: str
    ns: str
    o: dict[str, Any]
    ui: uuid.UUID | None
    o2: dict[str, Any] | None
    pre_image: dict[str, Any] | None
    post_image: dict[str, Any] | None


@dataclass(slots=True)
class Transaction:
    """One transaction of one session."""

    lsid: dict[str, Any]
    txn_number: int
    state: str = "in_progress"
    """``in_progress``, ``committed`` or ``aborted``."""
    ops: list[_PendingOp] = field(default_factory=list)
    undo: list[Callable[[], object]] = field(default_factory=list)

    def abort(self) -> None:
        """Undo the writes (newest first) and forget the buffered entries."""
        if self.state != "in_progress":
            return
        for revert in reversed(self.undo):
            revert()
        self.undo.clear()
        self.ops.clear()
        self.state = "aborted"


@dataclass(slots=True)
class RetryableWrite:
    """One retryable write of a session and the statements it has executed."""

    lsid: dict[str, Any]
    txn_number: int
    executed: dict[int, Any] = field(default_factory=dict)
    """Statement id -> what the statement returned (for the reply of a retry)."""
    oplog_lsid: dict[str, Any] | None = None
    """``lsid`` as its oplog entries carry it: one dict per session, not one per write
    (a busy session's oplog would otherwise hold a copy per entry)."""


NOT_EXECUTED: Any = object()
"""What :meth:`WriteUnit.statement` returns for a statement that must run."""


def _session_key(lsid: dict[str, Any]) -> bytes:
    ident = lsid.get("id")
    if isinstance(ident, uuid.UUID):
        return ident.bytes
    if isinstance(ident, bytes):
        return bytes(ident)
    raise CommandError(40415, "BSON field 'lsid.id' is missing or not a UUID")


def _sessions(ctx: CommandContext) -> dict[bytes, Transaction | RetryableWrite]:
    """The latest transaction or retryable write of every session, kept with the deployment."""
    return ctx.deployment.sessions


def session_keys(ctx: CommandContext) -> list[bytes]:
    """The ``lsid.id`` bytes of every session the deployment keeps state for."""
    return list(_sessions(ctx))


def session_uuid(lsid: dict[str, Any]) -> uuid.UUID:
    """``lsid.id`` as a UUID (for messages)."""
    return uuid.UUID(bytes=_session_key(lsid))


def abort_session(ctx: CommandContext, lsid: dict[str, Any]) -> None:
    """Abort the session's open transaction, if any (killSessions)."""
    current = _sessions(ctx).get(_session_key(lsid))
    if isinstance(current, Transaction):
        current.abort()


def abort_all_sessions(ctx: CommandContext) -> None:
    """Abort every open transaction (``killAllSessions: []``)."""
    for current in _sessions(ctx).values():
        if isinstance(current, Transaction):
            current.abort()


def retryable_write_for(ctx: CommandContext) -> RetryableWrite | None:
    """The retryable write this command belongs to (``_beginOrContinueRetryableWrite``).

    None without ``txnNumber`` or inside a transaction. A higher ``txnNumber``
    starts a new retryable write (aborting a transaction still open on the
    session); the same one continues it, so executed statements are skipped.
    """
    if ctx.txn_number is None or ctx.autocommit is not None:
        return None
    if ctx.lsid is None:
        raise CommandError(50768, "Transaction number requires a session ID to also be specified")
    key = _session_key(ctx.lsid)
    sessions = _sessions(ctx)
    current = sessions.get(key)
    number = ctx.txn_number
    if current is not None and current.txn_number > number:
        kind = "retryable write" if isinstance(current, RetryableWrite) else "transaction"
        raise CommandError(
            225,
            f"Retryable write with txnNumber {number} is prohibited on session "
            f"{uuid.UUID(bytes=key)} because a newer {kind} with txnNumber "
            f"{current.txn_number} has already started on this session.",
        )
    if current is None or number > current.txn_number:
        if isinstance(current, Transaction):
            current.abort()
        oplog_lsid = full_lsid(ctx.lsid, ctx.connection.user)
        if isinstance(current, RetryableWrite) and current.oplog_lsid == oplog_lsid:
            oplog_lsid = current.oplog_lsid  # one dict per session in the oplog
        retry = RetryableWrite(dict(ctx.lsid), number, oplog_lsid=oplog_lsid)
        sessions[key] = retry
        return retry
    if isinstance(current, Transaction):
        raise CommandError(
            217,
            "Cannot retry a retryable write that has been converted into a transaction",
            code_name="IncompleteTransactionHistory",
        )
    return current


def _no_such_transaction(message: str) -> CommandError:
    # The dispatcher labels 251 inside a transaction as TransientTransactionError.
    return CommandError(251, message)


def transaction_for(ctx: CommandContext) -> Transaction | None:
    """The transaction this command runs in (started by it if ``startTransaction``).

    None for commands outside a transaction (including retryable writes,
    which carry a ``txnNumber`` but no ``autocommit``).
    """
    if ctx.txn_number is None or ctx.autocommit is None:
        if ctx.start_transaction:
            raise CommandError(
                72,
                "Specifying startTransaction=true requires autocommit=false",
                code_name="InvalidOptions",
            )
        return None
    if ctx.autocommit:
        raise CommandError(72, "autocommit must be false", code_name="InvalidOptions")
    if ctx.lsid is None:
        raise CommandError(50768, "Transaction number requires a session ID to also be specified")
    key = _session_key(ctx.lsid)
    sessions = _sessions(ctx)
    current = sessions.get(key)
    number = ctx.txn_number
    if current is not None and current.txn_number > number:
        raise CommandError(
            225,
            f"Cannot start transaction {number} on session {uuid.UUID(bytes=key)} because a "
            f"newer transaction {current.txn_number} has already started.",
        )
    if ctx.start_transaction:
        if current is not None and current.txn_number == number:
            raise CommandError(
                117,
                f"Transaction with {{ txnNumber: {number} }} has already been started.",
                code_name="ConflictingOperationInProgress",
            )
        if isinstance(current, Transaction):
            current.abort()  # a newer transaction implicitly aborts the old one
        txn = Transaction(lsid=dict(ctx.lsid), txn_number=number)
        sessions[key] = txn
        return txn
    if not isinstance(current, Transaction) or current.txn_number != number:
        active = current.txn_number if current is not None else -1
        raise _no_such_transaction(
            f"Given transaction number {number} does not match any in-progress transactions. "
            f"The active transaction number is {active}"
        )
    if current.state == "aborted":
        raise _no_such_transaction(f"Transaction with {{ txnNumber: {number} }} has been aborted.")
    if current.state == "committed" and ctx.name not in ("commitTransaction", "abortTransaction"):
        raise CommandError(256, f"Transaction with {{ txnNumber: {number} }} has been committed.")
    return current


class WriteUnit:
    """Where one command's writes go: the oplog, or its transaction's buffer.

    In a retryable write, each statement is announced with :meth:`statement`
    (which tells whether it already ran) and confirmed with :meth:`done`;
    :meth:`commit` is where mongod commits a write unit of work (once per update or
    delete statement, once per batch of inserted documents), which is where the
    ``onPrimaryTransactionalWrite`` failpoint acts.
    """

    def __init__(
        self, ctx: CommandContext, txn: Transaction | None, retry: RetryableWrite | None = None
    ) -> None:
        self.ctx = ctx
        self.txn = txn
        self.retry = retry
        self.stmt_id: int | None = None
        self.retried: list[int] = []
        """Statement ids this retry did not execute again (``retriedStmtIds``)."""

    @classmethod
    def open(cls, ctx: CommandContext, *, ddl: bool = False) -> WriteUnit:
        """The unit for ``ctx``; DDL other than create/createIndexes is refused in a transaction."""
        txn = transaction_for(ctx)
        if txn is not None and ddl and ctx.name not in DDL_IN_TRANSACTION:
            raise CommandError(263, f"Cannot run '{ctx.name}' in a multi-document transaction.")
        retry = retryable_write_for(ctx) if txn is None and not ddl else None
        return cls(ctx, txn, retry)

    @property
    def in_transaction(self) -> bool:
        return self.txn is not None

    def statement_ids(self, count: int) -> list[int]:
        """The statement ids of ``count`` statements (``stmtIds``, or ``stmtId`` + index)."""
        body = self.ctx.body
        ids = body.get("stmtIds")
        if isinstance(ids, list):
            if len(ids) != count:
                raise CommandError(
                    16,
                    "Number of statement ids must match the number of batch entries. Got "
                    f"{len(ids)} statement ids but {count} operations.",
                    code_name="InvalidLength",
                )
            return [int(i) for i in ids]
        first = body.get("stmtId", 0)
        start = int(first) if isinstance(first, int) else 0
        return list(range(start, start + count))

    def statement(self, stmt_id: int, *, commit: bool = True) -> Any:
        """Start statement ``stmt_id``: its recorded result if this retryable write ran it.

        Otherwise :data:`NOT_EXECUTED`, and the statement's oplog entries will
        carry ``stmt_id``; with ``commit`` the statement is its own write unit of
        work (:meth:`commit`), as an update or delete statement is.
        """
        self.stmt_id = stmt_id
        if self.retry is None:
            return NOT_EXECUTED
        if stmt_id in self.retry.executed:
            self.retried.append(stmt_id)
            return self.retry.executed[stmt_id]
        if commit:
            self.commit()
        return NOT_EXECUTED

    def done(self, result: Any) -> None:
        """The current statement succeeded with ``result`` (what a retry will return)."""
        if self.retry is not None and self.stmt_id is not None:
            self.retry.executed[self.stmt_id] = result

    def commit(self) -> None:
        """``onPrimaryTransactionalWrite``, where mongod commits a write unit of work of a
        retryable write (``TransactionParticipant``, after each write).

        ``closeConnection`` (default true) ends the connection but not the operation: the
        command runs to its end and its reply is never sent. ``failBeforeCommitExceptionCode``
        fails the write before it is applied (the connection also closes unless
        ``closeConnection`` is false). mongod evaluates it when the write commits, so unlike
        here an update that matches nothing does not trigger it there.
        """
        if self.retry is None:
            return
        data = self.ctx.member.failpoints.on_primary_transactional_write()
        if data is None:
            return
        if data.get("closeConnection", True) is not False:
            self.ctx.close_connection = True
        code = data.get("failBeforeCommitExceptionCode")
        if isinstance(code, int) and not isinstance(code, bool):
            raise CommandError(
                code, "Failing write due to failpoint. The write must not be reflected."
            )

    def log(
        self,
        op: str,
        ns: str,
        o: dict[str, Any],
        *,
        ui: uuid.UUID | None = None,
        o2: dict[str, Any] | None = None,
        pre_image: dict[str, Any] | None = None,
        post_image: dict[str, Any] | None = None,
    ) -> None:
        """Record one oplog entry (nothing for the unreplicated ``local`` database)."""
        if ns.split(".", 1)[0] == "local":
            return
        if self.txn is not None:
            self.txn.ops.append(_PendingOp(op, ns, o, ui, o2, pre_image, post_image))
            return
        retry = self.retry
        entry = self.ctx.deployment.log(
            op,
            ns,
            o,
            ui=ui,
            o2=o2,
            pre_image=pre_image,
            post_image=post_image,
            lsid=retry.oplog_lsid if retry is not None else None,
            txn_number=Int64(retry.txn_number) if retry is not None else None,
            stmt_id=self.stmt_id if retry is not None else None,
        )
        self.ctx.operation_time = entry.ts

    def on_undo(self, revert: Callable[[], object]) -> None:
        """Remember how to revert the write just applied (only kept in a transaction)."""
        if self.txn is not None:
            self.txn.undo.append(revert)

    def fail(self) -> None:
        """A command failed inside the transaction: mongod aborts the whole transaction."""
        if self.txn is not None:
            self.txn.abort()


def session_uid(user: tuple[str, str] | None) -> Binary:
    """``lsid.uid``: SHA-256 of the authenticated ``user@db`` (of "" without authentication)."""
    if user is None:
        return NO_AUTH_UID
    uid: Binary = Binary(hashlib.sha256(f"{user[0]}@{user[1]}".encode()).digest(), 0)
    return uid


def full_lsid(lsid: dict[str, Any], user: tuple[str, str] | None = None) -> dict[str, Any]:
    """``{id, uid}`` as mongod writes a session id into the oplog."""
    return {"id": lsid["id"], "uid": lsid.get("uid", session_uid(user))}
