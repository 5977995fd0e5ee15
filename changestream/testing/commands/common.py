"""What several commands share: generic arguments, argument checks, and cursors over
materialized results (find, listCollections, listIndexes).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import bson
from bson.binary import UuidRepresentation
from bson.codec_options import CodecOptions

from ..core.context import CommandContext
from ..core.cursors import BatchBytes, CursorBatch, cursor_reply
from ..core.errors import CommandError
from ..storage import (
    CollectionState,
    bson_repr,
    check_collection_name,
    type_name,
    values_equal,
)

GENERIC_ARGS = frozenset(
    {
        "$db",
        "lsid",
        "txnNumber",
        "autocommit",
        "startTransaction",
        "writeConcern",
        "readConcern",
        "$readPreference",
        "$clusterTime",
        "comment",
        "maxTimeMS",
        "apiVersion",
        "apiStrict",
        "apiDeprecationErrors",
        "$audit",
        "$client",
        "mayBypassWriteBlocking",
        "stmtId",
        "stmtIds",
        "$configServerState",
        "$topologyTime",
        "databaseVersion",
        "shardVersion",
    }
)
"""Arguments every command accepts (mongod's generic arguments)."""



_SIZE_OPTIONS: CodecOptions[dict[str, Any]] = CodecOptions(
    uuid_representation=UuidRepresentation.STANDARD
)


# ======================================================================================
# Cursors over materialized results (find, listCollections, listIndexes)
# ======================================================================================


def lsid_bytes(ctx: CommandContext) -> bytes | None:
    """``lsid.id`` of the command as raw bytes (cursors remember their session)."""
    ident = (ctx.lsid or {}).get("id")
    if ident is None:
        return None
    return ident.bytes if hasattr(ident, "bytes") and not isinstance(ident, bytes) else bytes(ident)


class ListCursor:
    """A non-tailable cursor over a precomputed list of documents."""

    tailable_await = False

    def __init__(self, ns: str, docs: list[dict[str, Any]], lsid_id: bytes | None) -> None:
        self.open_after_full_batch = False
        """mongod's find stops at a full batch before it looks further, so a batch that
        exactly uses up the results leaves the cursor open for one more, empty getMore
        (``find_cmd.cpp``: ``enoughForFirstBatch`` is checked before ``getNext``)."""
        self.max_time_ms: int | None = None
        """The opening command's ``maxTimeMS``: its getMores have a time limit too."""
        self.ns = ns
        self.lsid_id = lsid_id
        self._docs = docs
        self._pos = 0

    def next_batch(self, batch_size: int | None) -> CursorBatch:
        """Up to ``batch_size`` documents (None: as many as fit in 16 MiB, as mongod counts)."""
        docs = self._docs
        limit = len(docs) if batch_size is None else min(len(docs), self._pos + batch_size)
        out: list[dict[str, Any]] = []
        size = BatchBytes()
        while self._pos < limit:
            doc = docs[self._pos]
            doc_size = len(bson.encode(doc, codec_options=_SIZE_OPTIONS))
            if not size.fits(doc_size):
                break
            out.append(doc)
            size.add(doc_size)
            self._pos += 1
        full = self.open_after_full_batch and batch_size is not None and len(out) == batch_size
        return CursorBatch(out, exhausted=self._pos >= len(docs) and not (full and out))

    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch:
        return self.next_batch(batch_size)

    def close(self) -> None:
        self._docs = []


def batch_size_arg(value: Any, command_name: str, default: int | None) -> int | None:
    """Validate a ``batchSize`` (``cursor.batchSize`` or find's own)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CommandError(
            14,
            f"BSON field '{command_name}.batchSize' is the wrong type '{type_name(value)}', "
            "expected types '[long, int, decimal, double]'",
        )
    if value < 0:
        raise CommandError(
            51024, f"BSON field 'batchSize' value must be >= 0, actual value '{int(value)}'"
        )
    return int(value)


def open_cursor(
    ctx: CommandContext,
    ns: str,
    docs: list[dict[str, Any]],
    batch_size: int | None,
    *,
    single_batch: bool = False,
    open_after_full_batch: bool = False,
) -> dict[str, Any]:
    """Reply with a first batch; register the cursor when documents remain."""
    cursor = ListCursor(ns, docs, lsid_bytes(ctx))
    cursor.open_after_full_batch = open_after_full_batch
    cursor.max_time_ms = ctx.max_time_ms
    batch = cursor.next_batch(batch_size)
    if single_batch:
        batch.exhausted = True
    cid = 0
    if not batch.exhausted:
        cid = ctx.deployment.cursors.register(cursor, ctx.member.name)
    return cursor_reply(cid, ns, batch, first=True)


def _cursor_options(ctx: CommandContext) -> int | None:
    spec = ctx.body.get("cursor", {})
    if not isinstance(spec, dict):
        raise CommandError(
            14,
            f"BSON field '{ctx.name}.cursor' is the wrong type '{type_name(spec)}', expected type "
            "'object'",
        )
    return batch_size_arg(spec.get("batchSize"), "cursor", None)




def collection_arg(ctx: CommandContext) -> str:
    """The command's collection name (its first value), validated."""
    name = ctx.target
    if not isinstance(name, str):
        raise CommandError(
            73,
            f"collection name has invalid type {type_name(name)}",
            code_name="InvalidNamespace",
        )
    check_collection_name(ctx.db, name)
    return name


def _check_fields(ctx: CommandContext, allowed: Iterable[str]) -> None:
    known = set(allowed) | GENERIC_ARGS | {ctx.name}
    for name in ctx.body:
        if name not in known:
            raise CommandError(40415, f"BSON field '{ctx.name}.{name}' is an unknown field.")


def _find_index(state: CollectionState, selector: Any) -> dict[str, Any]:
    if isinstance(selector, dict):
        found = [spec for spec in state.indexes if values_equal(spec["key"], selector)]
        if not found:
            raise CommandError(27, f"can't find index with key: {bson_repr(selector)}")
        if len(found) > 1:
            raise CommandError(
                2,
                f"{len(found)} indexes found for key: {bson_repr(selector)}, identify by name "
                "instead. Conflicting indexes: " + ", ".join(_spec_text(spec) for spec in found),
                code_name="AmbiguousIndexKeyPattern",
            )
        return found[0]
    spec = state.index(selector)
    if spec is None:
        raise CommandError(27, f"index not found with name [{selector}]")
    return spec


def _spec_text(spec: dict[str, Any]) -> str:
    return bson_repr({k: v for k, v in spec.items() if k != "ns"})
