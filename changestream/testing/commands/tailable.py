"""Tailable cursors: ``find`` with ``tailable`` (and ``awaitData``) on a capped collection or
on ``local.oplog.rs``.

mongod keeps such a cursor open when its results run out; a later getMore returns
what was written since (a capped collection's new documents in insertion order, the
oplog's new entries), and with ``awaitData`` it waits up to the getMore's ``maxTimeMS``
(default 1 s) for them (``find_cmd.cpp``, ``getmore_cmd.cpp``; "Tailable Cursors" in the
manual). Both read from the oplog, so a getMore costs what was written since, not a scan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any, Final

from bson.int64 import Int64

from ..core.context import CLIENT_CHECK_SECONDS, CommandContext, ConnectionInfo
from ..core.cursors import CursorBatch
from ..core.errors import CommandError
from ..core.oplog import Oplog, OplogEntry
from ..storage import compile_query, copy_value, id_key
from ..update import project

OPLOG_NS: Final = "local.oplog.rs"
DEFAULT_AWAIT_MS: Final = 1000


def oplog_document(entry: OplogEntry) -> dict[str, Any]:
    """An oplog entry as ``local.oplog.rs`` holds it (mongod 4.4+ field order)."""
    doc: dict[str, Any] = {}
    if entry.lsid is not None:
        doc["lsid"] = copy_value(entry.lsid)
        doc["txnNumber"] = Int64(entry.txn_number or 0)
    doc["op"] = entry.op
    doc["ns"] = entry.ns
    if entry.ui is not None:
        doc["ui"] = entry.ui
    doc["o"] = copy_value(entry.o)
    if entry.o2 is not None:
        doc["o2"] = copy_value(entry.o2)
    if entry.stmt_id is not None:
        doc["stmtId"] = entry.stmt_id
    doc["ts"] = entry.ts
    doc["t"] = Int64(entry.t)
    doc["v"] = Int64(2)
    doc["wall"] = entry.wall
    return doc


def oplog_documents(oplog: Oplog, query: dict[str, Any]) -> list[dict[str, Any]]:
    """The oplog entries matching ``query``, as ``local.oplog.rs`` documents, oldest first."""
    match = compile_query(query)
    out: list[dict[str, Any]] = []
    seq = oplog.first_seq
    while entries := oplog.read(max(seq, oplog.first_seq), 4096):
        seq = max(seq, oplog.first_seq) + len(entries)
        out.extend(doc for doc in map(oplog_document, entries) if match(doc))
    return out


def _inserts_into(entry: OplogEntry, ns: str) -> list[dict[str, Any]]:
    """The documents ``entry`` inserted into ``ns`` (a transaction's too)."""
    if entry.op == "i" and entry.ns == ns:
        return [entry.o]
    if entry.txn_ops:
        return [op.o for op in entry.txn_ops if op.op == "i" and op.ns == ns]
    return []


class TailableCursor:
    """A tailable cursor: the first results, then what the oplog brings."""

    def __init__(
        self,
        ctx: CommandContext,
        ns: str,
        query: dict[str, Any],
        projection: dict[str, Any] | None,
        *,
        await_data: bool,
        first: list[dict[str, Any]],
    ) -> None:
        self.ns = ns
        self.lsid_id = _lsid(ctx)
        self.tailable_await = await_data
        self._oplog: Oplog = ctx.deployment.oplog
        self._match: Callable[[dict[str, Any]], bool] = compile_query(query)
        self._query = query
        self._projection = projection
        self._pending = [self._shown(doc) for doc in first]
        tail_oplog = ns == OPLOG_NS
        self._seq = self._oplog.first_seq if tail_oplog else self._oplog.end_seq
        self._docs_of: Callable[[OplogEntry], list[dict[str, Any]]] = (
            (lambda e: [oplog_document(e)]) if tail_oplog else (lambda e: _inserts_into(e, ns))
        )
        self._closed = False
        self._capped = (
            None if tail_oplog else ctx.deployment.catalog.get(ctx.db, ns.split(".", 1)[1])
        )
        self._last_key: Hashable | None = None
        """``_id`` key of the last capped document returned (gone: CappedPositionLost)."""

    def next_batch(self, batch_size: int | None) -> CursorBatch:
        """What is there now, up to ``batch_size`` documents; never exhausted."""
        self._read_oplog(batch_size)
        limit = len(self._pending) if batch_size is None else batch_size
        out, self._pending = self._pending[:limit], self._pending[limit:]
        if out and self._capped is not None and "_id" in out[-1]:
            self._last_key = id_key(out[-1]["_id"])
        return CursorBatch(out)

    def _check_position(self) -> None:
        """CappedPositionLost (136) when the last document returned was evicted, as mongod's
        ``CollectionScan`` fails a tailable scan whose position was deleted."""
        state = self._capped
        if state is None or self._last_key is None or state.lookup(self._last_key) is not None:
            return
        raise CommandError(
            136,
            "CollectionScan died due to position in capped collection being deleted.",
            code_name="CappedPositionLost",
        )

    def _read_oplog(self, batch_size: int | None) -> None:
        while batch_size is None or len(self._pending) < batch_size:
            start = max(self._seq, self._oplog.first_seq)
            entries = self._oplog.read(start, 256)
            if not entries:
                return
            self._seq = start + len(entries)
            for entry in entries:
                for doc in self._docs_of(entry):
                    if self._match(doc):
                        self._pending.append(self._shown(doc))

    def _shown(self, doc: dict[str, Any]) -> dict[str, Any]:
        if self._projection:
            return project(doc, self._projection, query=self._query)
        shown: dict[str, Any] = copy_value(doc)
        return shown

    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch:
        self._check_position()
        batch = self.next_batch(batch_size)
        if batch.documents or not self.tailable_await:
            return batch
        wait_ms = DEFAULT_AWAIT_MS if max_time_ms is None else max_time_ms
        deadline = time.monotonic() + wait_ms / 1000
        while not batch.documents and self._wait(deadline, ctx.connection):
            batch = self.next_batch(batch_size)
        return batch

    def _wait(self, deadline: float, conn: ConnectionInfo | None) -> bool:
        """Block until the oplog grows or ``deadline`` (False: time is up)."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        grew = self._oplog.wait_for(self._seq, min(left, CLIENT_CHECK_SECONDS))
        if self._closed:
            raise CommandError(237, "operation was interrupted")
        if conn is not None:
            conn.check_connected()
        return grew or deadline > time.monotonic()

    def close(self) -> None:
        self._closed = True
        self._pending = []
        self._oplog.notify()


def _lsid(ctx: CommandContext) -> bytes | None:
    ident = (ctx.lsid or {}).get("id")
    if ident is None:
        return None
    return ident.bytes if hasattr(ident, "bytes") and not isinstance(ident, bytes) else bytes(ident)


def check_tailable(ctx: CommandContext, coll: str) -> tuple[bool, bool]:
    """``(tailable, awaitData)`` of a find, refused as mongod refuses them."""
    body = ctx.body
    tailable, await_data = bool(body.get("tailable")), bool(body.get("awaitData"))
    if await_data and not tailable:
        raise CommandError(9, "Cannot set 'awaitData' without also setting 'tailable'")
    if not tailable:
        return False, False
    ns = f"{ctx.db}.{coll}"
    state = ctx.deployment.catalog.get(ctx.db, coll)
    if ns != OPLOG_NS and (state is None or not state.options.get("capped")):
        raise CommandError(
            2,
            f"error processing query: ns={ns} planner returned error :: caused by :: "
            "tailable cursor requested on non capped collection",
        )
    return True, await_data
