"""The ``bulkWrite`` command (8.0+): inserts, updates and deletes over many namespaces.

Follows ``bulk_write.cpp`` / ``bulk_write.idl``: ops run in order against
their ``nsInfo`` namespace through the same statement functions as the
``insert``/``update``/``delete`` commands (so oplog entries, change events and
retryable-write de-duplication are identical), each op answers with one reply
item, and the reply is a cursor (``admin.$cmd.bulkWrite``) plus summary counts.
"""

from __future__ import annotations

from typing import Any, Final

from bson.int64 import Int64

from ..core.context import CommandContext
from ..core.errors import CommandError
from ..storage import DuplicateKey, bson_repr, check_collection_name, type_name
from ..storage.sessions import WriteUnit
from .common import GENERIC_ARGS, ListCursor, lsid_bytes
from .crud import (
    MAX_WRITE_BATCH,
    as_command_error,
    check_writable,
    delete_statement,
    insert_one,
    repl_fields,
    run_statement,
    update_statement,
)
from .ddl import ensure_collection
from .spec import command

CURSOR_NS: Final = "admin.$cmd.bulkWrite"
_FIELDS: Final = frozenset(
    {
        "ops",
        "nsInfo",
        "cursor",
        "bypassDocumentValidation",
        "ordered",
        "stmtId",
        "stmtIds",
        "let",
        "errorsOnly",
        "bypassEmptyTsReplacement",
    }
)
_OP_FIELDS: Final = {
    "insert": frozenset({"insert", "document"}),
    "update": frozenset(
        {
            "update",
            "filter",
            "sort",
            "multi",
            "updateMods",
            "upsert",
            "upsertSupplied",
            "arrayFilters",
            "hint",
            "constants",
            "collation",
            "sampleId",
            "$_allowShardKeyUpdatesWithoutFullShardKeyInQuery",
        }
    ),
    "delete": frozenset({"delete", "filter", "multi", "hint", "collation", "sampleId"}),
}
_REQUIRED: Final = {
    "insert": ("document",),
    "update": ("filter", "updateMods"),
    "delete": ("filter",),
}
_NS_INFO_FIELDS: Final = frozenset(
    {"ns", "collectionUUID", "encryptionInformation", "isTimeseriesNamespace", "shardVersion",
     "databaseVersion"}
)  # fmt: skip
_MULTI_RETRY: Final = "Cannot use retryable writes with multi=true"


def _wrong_type(field: str, value: Any, expected: str) -> CommandError:
    return CommandError(
        14,
        f"BSON field '{field}' is the wrong type '{type_name(value)}', expected type '{expected}'",
    )


def _array(ctx: CommandContext, field: str) -> list[Any]:
    value = ctx.body.get(field)
    if value is None:
        raise CommandError(40414, f"BSON field 'bulkWrite.{field}' is missing but a required field")
    if not isinstance(value, list):
        raise _wrong_type(f"bulkWrite.{field}", value, "array")
    return value


def _parse_op(raw: Any) -> tuple[str, int, dict[str, Any]]:
    """(kind, nsInfo index, op) of one ``ops`` entry, checked as the IDL variant parse does."""
    if not isinstance(raw, dict) or not raw:
        raise _wrong_type("bulkWrite.ops", raw, "object")
    kind = next(iter(raw))
    allowed = _OP_FIELDS.get(kind)
    if allowed is None:
        raise CommandError(40415, f"BSON field 'bulkWrite.ops.{kind}' is an unknown field.")
    for name in raw:
        if name not in allowed:
            raise CommandError(40415, f"BSON field 'bulkWrite.ops.{name}' is an unknown field.")
    for name in _REQUIRED[kind]:
        if name not in raw:
            raise CommandError(
                40414, f"BSON field 'bulkWrite.ops.{name}' is missing but a required field"
            )
    index = raw[kind]
    if isinstance(index, bool) or not isinstance(index, (int, float)) or index != int(index):
        raise _wrong_type(f"bulkWrite.ops.{kind}", index, "int")
    if index < 0:
        raise CommandError(
            51024, f"BSON field '{kind}' value must be >= 0, actual value '{int(index)}'"
        )
    for name, expected, shown in (
        ("document", dict, "object"),
        ("filter", dict, "object"),
        ("multi", bool, "bool"),
        ("upsert", bool, "bool"),
    ):
        if name in raw and not isinstance(raw[name], expected):
            raise _wrong_type(f"bulkWrite.ops.{name}", raw[name], shown)
    return kind, int(index), raw


def _parse_namespaces(entries: list[Any]) -> list[tuple[str, str]]:
    """The ``nsInfo`` namespaces as (db, collection); InvalidNamespace for bad ones."""
    namespaces = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise _wrong_type("bulkWrite.nsInfo", entry, "object")
        for name in entry:
            if name not in _NS_INFO_FIELDS:
                raise CommandError(
                    40415, f"BSON field 'bulkWrite.nsInfo.{name}' is an unknown field."
                )
        ns = entry.get("ns")
        if not isinstance(ns, str):
            raise CommandError(
                40414, "BSON field 'bulkWrite.nsInfo.ns' is missing but a required field"
            )
        db, _, coll = ns.partition(".")
        try:
            check_collection_name(db, coll)
        except CommandError:
            raise CommandError(73, f"Invalid namespace specified for bulkWrite: '{ns}'") from None
        namespaces.append((db, coll))
    return namespaces


def _error_item(index: int, err: CommandError | DuplicateKey, kind: str) -> dict[str, Any]:
    """``BulkWriteReplyItem`` of a failed op: ok 0, idx, code, errmsg, extra info, n 0."""
    error = as_command_error(err)
    item: dict[str, Any] = {"ok": 0.0, "idx": index, "code": error.code, "errmsg": error.errmsg}
    item.update(error.extra)
    item["n"] = 0
    if kind == "update":
        item["nModified"] = 0
    return item


class _Summary:
    """The reply items and the counts ``BulkWriteReplies`` keeps."""

    def __init__(self, errors_only: bool) -> None:
        self.errors_only = errors_only
        self.items: list[dict[str, Any]] = []
        self.counts = dict.fromkeys(
            ("nErrors", "nInserted", "nMatched", "nModified", "nUpserted", "nDeleted"), 0
        )

    def add(self, item: dict[str, Any]) -> None:
        if item["ok"] == 0.0:
            self.counts["nErrors"] += 1
        elif self.errors_only:
            return
        self.items.append(item)

    def inserted(self, index: int) -> None:
        self.counts["nInserted"] += 1
        self.add({"ok": 1.0, "idx": index, "n": 1})

    def updated(
        self, index: int, matched: int, modified: int, upserted_id: tuple[Any] | None
    ) -> None:
        item: dict[str, Any] = {"ok": 1.0, "idx": index}
        self.counts["nModified"] += modified
        if upserted_id is not None:
            self.counts["nUpserted"] += 1
            item.update(n=1, nModified=modified, upserted={"_id": upserted_id[0]})
        else:
            self.counts["nMatched"] += matched
            item.update(n=matched, nModified=modified)
        self.add(item)

    def deleted(self, index: int, n: int) -> None:
        self.counts["nDeleted"] += n
        self.add({"ok": 1.0, "idx": index, "n": n})


def _run_op(
    ctx: CommandContext,
    unit: WriteUnit,
    kind: str,
    op: dict[str, Any],
    namespace: tuple[str, str],
) -> Any:
    """Execute one op (its ``bulkWrite`` checks, then the shared statement function)."""
    db, coll = namespace
    if kind == "insert":
        check_writable(ctx, db, coll)
        insert_one(ctx, unit, ensure_collection(unit, db, coll), op["document"])
        return None
    if op.get("multi") and unit.retry is not None:
        raise CommandError(72, _MULTI_RETRY)
    if kind == "update":
        stmt = {
            "q": op["filter"],
            "u": op["updateMods"],
            "multi": op.get("multi", False),
            "upsert": op.get("upsert", False),
            "arrayFilters": op.get("arrayFilters"),
        }
        return update_statement(ctx, unit, db, coll, stmt)
    return delete_statement(ctx, unit, db, coll, op["filter"], 0 if op.get("multi") else 1)


@command("bulkWrite", admin_only=True, write=True, requires="bulk_write")
def bulk_write(ctx: CommandContext) -> dict[str, Any]:
    """Run every op in order (stopping at the first error when ``ordered``)."""
    for name in ctx.body:
        if name not in _FIELDS and name not in GENERIC_ARGS and name != ctx.name:
            raise CommandError(40415, f"BSON field 'bulkWrite.{name}' is an unknown field.")
    raw_ops = _array(ctx, "ops")
    namespaces = _parse_namespaces(_array(ctx, "nsInfo"))
    if not 0 < len(raw_ops) <= MAX_WRITE_BATCH:
        raise CommandError(
            16,
            f"Write batch sizes must be between 1 and {MAX_WRITE_BATCH}. Got {len(raw_ops)} "
            "operations.",
            code_name="InvalidLength",
        )
    ops = [_parse_op(raw) for raw in raw_ops]
    for _kind, ns_index, op in ops:
        if ns_index >= len(namespaces):
            raise CommandError(
                2, f"BulkWrite ops entry {bson_repr(op)} has an invalid nsInfo index."
            )
    ordered = ctx.body.get("ordered", True) is not False
    unit = WriteUnit.open(ctx)
    stmt_ids = unit.statement_ids(len(ops))
    summary = _Summary(bool(ctx.body.get("errorsOnly", False)))
    for index, (kind, ns_index, op) in enumerate(ops):

        def run(kind: str = kind, op: dict[str, Any] = op, ns_index: int = ns_index) -> Any:
            return _run_op(ctx, unit, kind, op, namespaces[ns_index])

        try:
            result = run_statement(unit, stmt_ids[index], run)
        except (CommandError, DuplicateKey) as err:
            if unit.in_transaction:
                unit.fail()
                raise as_command_error(err) from None
            summary.add(_error_item(index, err, kind))
            if ordered:
                break
            continue
        if kind == "insert":
            summary.inserted(index)
        elif kind == "update":
            summary.updated(index, *result)
        else:
            summary.deleted(index, result)
    return _reply(ctx, unit, summary)


def _reply(ctx: CommandContext, unit: WriteUnit, summary: _Summary) -> dict[str, Any]:
    """``BulkWriteCommandReply``: cursor {id, firstBatch, ns}, counts, electionId, opTime."""
    spec = ctx.body.get("cursor")
    batch_size = spec.get("batchSize") if isinstance(spec, dict) else None
    cursor = ListCursor(CURSOR_NS, summary.items, lsid_bytes(ctx))
    batch = cursor.next_batch(batch_size or None)  # batchSize 0 means "no limit" here
    cid = 0 if batch.exhausted else ctx.deployment.cursors.register(cursor, ctx.member.name)
    reply: dict[str, Any] = {
        "cursor": {"id": Int64(cid), "firstBatch": batch.documents, "ns": CURSOR_NS}
    }
    reply.update(summary.counts)
    reply.update(repl_fields(ctx))
    if unit.retried:
        reply["retriedStmtIds"] = list(unit.retried)
    return reply
