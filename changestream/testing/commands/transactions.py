"""``commitTransaction`` and ``abortTransaction``: end a session's transaction.

The transaction state itself (and every write's :class:`WriteUnit`) lives in
:mod:`changestream.testing.storage.sessions`.
"""

from __future__ import annotations

from typing import Any

from bson.int64 import Int64

from ..core.context import CommandContext
from ..core.errors import CommandError
from ..core.oplog import OplogEntry
from ..storage.sessions import Transaction, full_lsid, transaction_for
from .spec import command


def _end_target(ctx: CommandContext) -> Transaction:
    txn = transaction_for(ctx)
    if txn is None:
        raise CommandError(
            125 if ctx.txn_number is None else 72,
            f"{ctx.name} must be run within a transaction",
            code_name="CommandFailed" if ctx.txn_number is None else "InvalidOptions",
        )
    return txn


@command("commitTransaction", admin_only=True, write=True)
def commit_transaction(ctx: CommandContext) -> dict[str, Any]:
    """Log the transaction's writes as one ``applyOps`` entry at one timestamp."""
    txn = _end_target(ctx)
    if txn.state == "committed":
        return {}
    if txn.ops:
        deployment = ctx.deployment
        ts = deployment.clock.tick()
        wall = deployment.clock.wall()
        inner = [
            OplogEntry(
                ts=ts,
                wall=wall,
                op=p.op,
                ns=p.ns,
                o=p.o,
                ui=p.ui,
                o2=p.o2,
                t=deployment.term,
                pre_image=p.pre_image,
                post_image=p.post_image,
            )
            for p in txn.ops
        ]
        apply_ops = []
        for p in txn.ops:
            doc: dict[str, Any] = {"op": p.op, "ns": p.ns}
            if p.ui is not None:
                doc["ui"] = p.ui
            doc["o"] = p.o
            if p.o2 is not None:
                doc["o2"] = p.o2
            apply_ops.append(doc)
        entry = deployment.log(
            "c",
            "admin.$cmd",
            {"applyOps": apply_ops},
            lsid=full_lsid(txn.lsid, ctx.connection.user),
            txn_number=Int64(txn.txn_number),
            txn_ops=inner,
            ts=ts,
            wall=wall,
        )
        ctx.operation_time = entry.ts
    txn.state = "committed"
    txn.ops.clear()
    txn.undo.clear()
    return {}


@command("abortTransaction", admin_only=True, write=True)
def abort_transaction(ctx: CommandContext) -> dict[str, Any]:
    """Revert the transaction's writes; nothing reaches the oplog."""
    txn = _end_target(ctx)
    if txn.state == "committed":
        raise CommandError(
            256, f"Transaction with {{ txnNumber: {txn.txn_number} }} has been committed."
        )
    txn.abort()
    return {}
