"""CRUD writes: insert, update, delete, findAndModify (the reads are in :mod:`.reads`).

Each write logs exactly the oplog entries mongod writes: ``i`` with the full
document (``o2 = {_id}``), ``u`` with a ``$v: 2`` diff or a whole replacement
document, ``d`` with ``{_id}``; nothing for an update that changes nothing.
An upsert that inserts logs an insert. Collections with
``changeStreamPreAndPostImages`` enabled get their pre-images (and, for
diff updates, post-images) attached to the entries.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Hashable
from typing import Any

import bson
from bson.binary import UuidRepresentation
from bson.codec_options import CodecOptions
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.regex import Regex

from ..core.context import CommandContext
from ..core.errors import CommandError
from ..core.nesting import storage_depth_error
from ..storage import (
    CollectionState,
    DuplicateKey,
    copy_value,
    id_key,
    matches,
    type_name,
)
from ..storage.sessions import NOT_EXECUTED, WriteUnit
from ..update import Outcome, Update, UpdateEnv, project
from .common import collection_arg
from .ddl import ensure_collection
from .reads import matching, query_arg, sorted_documents
from .spec import command

_WRITABLE_SYSTEM_COLLECTIONS = frozenset({"system.js"})
MAX_WRITE_BATCH = 100_000
INSERT_BATCH_DOCS = 64
"""mongod's ``internalInsertMaxBatchSize``: documents an insert commits together."""
INSERT_BATCH_BYTES = 256 * 1024
"""mongod's ``insertVectorMaxBytes``: a batch is committed once its documents reach this."""
BSON_OBJ_MAX_USER_SIZE = 16 * 1024 * 1024
"""mongod's ``BSONObjMaxUserSize``: the largest document it stores."""
_SIZE_OPTIONS: CodecOptions[dict[str, Any]] = CodecOptions(
    uuid_representation=UuidRepresentation.STANDARD
)


def _bson_size(doc: dict[str, Any]) -> int:
    """``doc``'s BSON size (native UUIDs as subtype 4, as the simulator stores them)."""
    return len(bson.encode(doc, codec_options=_SIZE_OPTIONS))


# ======================================================================================
# Shared helpers
# ======================================================================================


def repl_fields(ctx: CommandContext) -> dict[str, Any]:
    """``electionId`` and ``opTime``: what mongod adds to write replies on a replica set."""
    deployment = ctx.deployment
    if deployment.standalone:
        return {}
    ts = ctx.operation_time or deployment.last_applied()
    return {
        "electionId": ObjectId(f"7fffffff{deployment.term:016x}"),
        "opTime": {"ts": ts, "t": Int64(deployment.term)},
    }


def check_writable(ctx: CommandContext, db: str, coll: str) -> CollectionState | None:
    """The target collection (None if missing); refuse views and system collections."""
    if coll.startswith("system.") and coll not in _WRITABLE_SYSTEM_COLLECTIONS:
        raise CommandError(73, f"Invalid system namespace: {db}.{coll}")
    state = ctx.deployment.catalog.get(db, coll)
    if state is not None and state.is_view:
        raise CommandError(166, f"Namespace {state.ns} is a view, not a collection")
    return state


def _env(ctx: CommandContext) -> UpdateEnv:
    clock = ctx.deployment.clock
    return UpdateEnv(now=clock.wall, timestamp=clock.tick)


def _validation_error(doc: dict[str, Any]) -> CommandError:
    return CommandError(
        121, "Document failed validation", extra={"errInfo": {"failingDocumentId": doc["_id"]}}
    )


def _validate(
    ctx: CommandContext, state: CollectionState, doc: dict[str, Any], old: dict[str, Any] | None
) -> None:
    """Enforce the collection's validator (error action; ``moderate`` skips invalid old docs)."""
    validator = state.options.get("validator")
    if not validator or ctx.body.get("bypassDocumentValidation"):
        return
    level = state.options.get("validationLevel", "strict")
    if level == "off" or state.options.get("validationAction", "error") == "warn":
        return
    try:
        if level == "moderate" and old is not None and not matches(validator, old):
            return
        valid = matches(validator, doc)
    except CommandError:
        return  # operators mongomock cannot evaluate ($jsonSchema, ...): accept
    if not valid:
        raise _validation_error(doc)


def write_error(index: int, err: CommandError | DuplicateKey) -> dict[str, Any]:
    if isinstance(err, DuplicateKey):
        return err.write_error(index)
    out: dict[str, Any] = {"index": index, "code": err.code}
    out.update(err.extra)
    out["errmsg"] = err.errmsg
    return out


def as_command_error(err: CommandError | DuplicateKey) -> CommandError:
    return err.command_error() if isinstance(err, DuplicateKey) else err


def _statements(ctx: CommandContext, field: str, required: tuple[str, ...] = ()) -> list[Any]:
    items = ctx.body.get(field)
    if not isinstance(items, list):
        raise CommandError(
            40414 if items is None else 14,
            f"BSON field '{ctx.name}.{field}' is missing but a required field"
            if items is None
            else f"BSON field '{ctx.name}.{field}' is the wrong type '{type_name(items)}', "
            "expected type 'array'",
        )
    if not 0 < len(items) <= MAX_WRITE_BATCH:
        raise CommandError(
            16,
            f"Write batch sizes must be between 1 and {MAX_WRITE_BATCH}. Got {len(items)} "
            "operations.",
            code_name="InvalidLength",
        )
    for item in items if required else ():
        if not isinstance(item, dict):
            raise CommandError(
                14,
                f"BSON field '{ctx.name}.{field}' is the wrong type '{type_name(item)}', "
                "expected type 'object'",
            )
        for name in required:
            if name not in item:
                raise CommandError(
                    40414, f"BSON field '{ctx.name}.{field}.{name}' is missing but a required field"
                )
    return items


def _write_reply(
    ctx: CommandContext, unit: WriteUnit, n: int, errors: list[dict[str, Any]], **tail: Any
) -> dict[str, Any]:
    """``WriteCommandReplyBase`` (n, electionId, opTime, writeErrors, retriedStmtIds), then ``tail``."""
    reply: dict[str, Any] = {"n": n, **repl_fields(ctx)}
    if errors:
        reply["writeErrors"] = errors
    if unit.retried and ctx.deployment.profile.retried_stmt_ids:
        reply["retriedStmtIds"] = list(unit.retried)
    reply.update(tail)
    return reply


_MULTI_RETRY_ERROR = "Cannot use (or request) retryable writes with {}"
"""The write commands' refusal of multi-document statements in a retryable write."""


# ======================================================================================
# The storage-level writes (apply + log + undo)
# ======================================================================================


def _prepare_insert(raw: Any) -> dict[str, Any]:
    """``_id`` first (an ObjectId when missing), with mongod's ``_id``/field-name checks."""
    if not isinstance(raw, dict):
        raise CommandError(14, "documents must be objects")
    too_deep = storage_depth_error(raw)  # checked first, as in fixDocumentForInsert
    if too_deep is not None:
        raise CommandError(15, too_deep)
    doc: dict[str, Any] = raw
    if "_id" not in doc:
        doc = {"_id": ObjectId(), **doc}
    elif next(iter(doc)) != "_id":
        doc = {"_id": doc["_id"], **{k: v for k, v in doc.items() if k != "_id"}}
    size = _bson_size(doc)
    if size > BSON_OBJ_MAX_USER_SIZE:
        # fixDocumentForInsert (src/mongo/db/ops/insert.cpp): BadValue
        raise CommandError(
            2,
            f"object to insert too large. size in bytes: {size}, "
            f"max size: {BSON_OBJ_MAX_USER_SIZE}",
        )
    id_value = doc["_id"]
    if isinstance(id_value, list):
        raise CommandError(2, "can't use an array for _id")
    if isinstance(id_value, (Regex, re.Pattern)):
        raise CommandError(2, "can't use a regex for _id")
    for name in doc:
        if name.startswith("$"):
            raise CommandError(2, f"Document can't have $ prefixed field names: {name}")
    return doc


def _insert_document(unit: WriteUnit, state: CollectionState, doc: dict[str, Any]) -> None:
    """Store a prepared document and log its insert (raises DuplicateKey)."""
    key = state.insert(doc)
    unit.on_undo(functools.partial(state.remove, key))
    unit.log("i", state.ns, copy_value(doc), ui=state.uuid, o2=state.document_key(doc))


def _store_update(
    unit: WriteUnit, state: CollectionState, old: dict[str, Any], outcome: Outcome
) -> None:
    """Replace ``old`` by ``outcome.doc`` and log the update or replacement."""
    assert outcome.oplog_o is not None
    if _bson_size(outcome.doc) > BSON_OBJ_MAX_USER_SIZE:
        # update_stage.cpp: uassert 17419 on the updated document's size
        raise CommandError(
            17419,
            f"Resulting document after update is larger than {BSON_OBJ_MAX_USER_SIZE}",
            code_name="Location17419",
        )
    key: Hashable = id_key(old["_id"])
    state.replace(key, outcome.doc)
    unit.on_undo(functools.partial(state.replace, key, old))
    images = state.pre_post_images
    # 4.x logged $v:1 updates that carried whole values; the simulator logs $v:2 diffs
    # everywhere and keeps the post-image so those versions' update descriptions can be built.
    legacy = not unit.ctx.deployment.profile.v2_update_oplog
    unit.log(
        "u",
        state.ns,
        outcome.oplog_o,
        ui=state.uuid,
        o2=state.document_key(old),
        pre_image=copy_value(old) if images else None,
        post_image=(
            copy_value(outcome.doc) if (images or legacy) and not outcome.replacement else None
        ),
    )


def _delete_document(unit: WriteUnit, state: CollectionState, doc: dict[str, Any]) -> None:
    state.remove(id_key(doc["_id"]))
    unit.on_undo(functools.partial(state.insert, doc))
    unit.log(
        "d",
        state.ns,
        state.document_key(doc),
        ui=state.uuid,
        pre_image=copy_value(doc) if state.pre_post_images else None,
    )


def _upsert(
    ctx: CommandContext,
    unit: WriteUnit,
    db: str,
    coll: str,
    update: Update,
    query: dict[str, Any],
) -> dict[str, Any]:
    """Insert the document an upsert builds; return it."""
    doc = _prepare_insert(update.upsert_document(query, _env(ctx)))
    state = ensure_collection(unit, db, coll)
    _validate(ctx, state, doc, None)
    _insert_document(unit, state, doc)
    return doc


# ======================================================================================
# insert / update / delete
# ======================================================================================


def insert_one(ctx: CommandContext, unit: WriteUnit, state: CollectionState, raw: Any) -> None:
    """Insert one client document into ``state`` (raises CommandError / DuplicateKey)."""
    doc = _prepare_insert(raw)
    if state.options.get("validator"):
        _validate(ctx, state, doc, None)
    _insert_document(unit, state, doc)
    if state.options.get("capped"):
        _evict_capped(state)


def _evict_capped(state: CollectionState) -> None:
    """Drop a capped collection's oldest documents beyond its ``max`` documents or ``size`` bytes.

    As mongod's capped collections (the manual's "Capped Collections"); the sizes are
    summed per insert, so large capped collections cost a scan per insert here.
    """
    max_docs = state.options.get("max")
    over = len(state) - int(max_docs) if isinstance(max_docs, (int, float)) and max_docs > 0 else 0
    size = state.options.get("size")
    keys = [key for key, _ in state.stored_items()]
    drop = set(keys[: max(over, 0)])
    if isinstance(size, (int, float)) and size > 0:
        total = sum(_bson_size(doc) for doc in state.iter_stored())
        for key in keys:
            if total <= size or len(drop) >= len(keys) - 1:
                break
            if key not in drop:
                total -= _bson_size(state.lookup(key) or {})
                drop.add(key)
    for key in keys:
        if key in drop:
            state.remove(key)


@command("insert", write=True)
def insert(ctx: CommandContext) -> dict[str, Any]:
    coll = collection_arg(ctx)
    documents = _statements(ctx, "documents")
    ordered = ctx.body.get("ordered", True) is not False
    unit = WriteUnit.open(ctx)
    stmt_ids = unit.statement_ids(len(documents))
    check_writable(ctx, ctx.db, coll)
    state = ensure_collection(unit, ctx.db, coll)
    n = 0
    errors: list[dict[str, Any]] = []
    batch: list[tuple[int, int, Any]] = []
    size = 0
    for i, raw in enumerate(documents):
        if unit.statement(stmt_ids[i], commit=False) is not NOT_EXECUTED:
            n += 1
            continue
        batch.append((i, stmt_ids[i], raw))
        size += _bson_size(raw) if isinstance(raw, dict) else 0
        if i + 1 < len(documents) and len(batch) < INSERT_BATCH_DOCS and size < INSERT_BATCH_BYTES:
            continue
        inserted, stop = _insert_batch(ctx, unit, state, batch, errors, ordered=ordered)
        n += inserted
        batch, size = [], 0
        if stop:
            break
    if batch:
        n += _insert_batch(ctx, unit, state, batch, errors, ordered=ordered)[0]
    return _write_reply(ctx, unit, n, errors)


def _insert_batch(
    ctx: CommandContext,
    unit: WriteUnit,
    state: CollectionState,
    batch: list[tuple[int, int, Any]],
    errors: list[dict[str, Any]],
    *,
    ordered: bool,
) -> tuple[int, bool]:
    """Insert ``(index, stmtId, document)``s as one write unit of work, as mongod's
    ``insertBatchAndHandleErrors`` does: a batch that fails to commit is tried again one
    document at a time. Returns (inserted, stop)."""
    try:
        unit.commit()
    except CommandError as err:
        if len(batch) > 1 and not unit.in_transaction:
            inserted = 0
            for item in batch:
                one, stop = _insert_batch(ctx, unit, state, [item], errors, ordered=ordered)
                inserted += one
                if stop:
                    return inserted, True
            return inserted, False
        errors.append(write_error(batch[0][0], err))
        return 0, ordered
    inserted = 0
    for i, stmt_id, raw in batch:
        unit.stmt_id = stmt_id
        try:
            insert_one(ctx, unit, state, raw)
        except (CommandError, DuplicateKey) as err:
            if unit.in_transaction:
                unit.fail()
                raise as_command_error(err) from None
            errors.append(write_error(i, err))
            if ordered:
                return inserted, True
            continue
        unit.done(None)
        inserted += 1
    return inserted, False


UpdateResult = tuple[int, int, tuple[Any] | None]
"""(matched, modified, ``(upserted _id,)`` or None): what an update statement did (the
``_id`` is boxed: an upsert may insert ``_id: null``, and mongod reports it)."""


def update_statement(
    ctx: CommandContext, unit: WriteUnit, db: str, coll: str, stmt: dict[str, Any]
) -> UpdateResult:
    """Run one update statement (``q``, ``u``, ``multi``, ``upsert``, ``arrayFilters``)."""
    query = query_arg(stmt.get("q"), f"{ctx.name}.updates.q")
    multi = bool(stmt.get("multi", False))
    update = Update(stmt["u"], array_filters=stmt.get("arrayFilters"), multi=multi)
    state = check_writable(ctx, db, coll)
    targets = matching(state, query, limit=0 if multi else 1)
    matched = modified = 0
    env = _env(ctx)
    for old in targets:
        assert state is not None
        outcome = update.apply(old, env, query=query)
        matched += 1
        if outcome.oplog_o is None:
            continue
        _validate(ctx, state, outcome.doc, old)
        _store_update(unit, state, old, outcome)
        modified += 1
    if matched or not stmt.get("upsert"):
        return matched, modified, None
    doc = _upsert(ctx, unit, db, coll, update, query)
    return 1, 0, (doc["_id"],)


def run_statement(unit: WriteUnit, stmt_id: int, run: Callable[[], Any]) -> Any:
    """Run one statement of a write command once: a retry gets the recorded result back.

    ``run`` raises for a failed statement; its result is recorded for retries
    and the statement's commit point passed.
    """
    previous = unit.statement(stmt_id)
    if previous is not NOT_EXECUTED:
        return previous
    result = run()
    unit.done(result)
    return result


@command("update", write=True)
def update(ctx: CommandContext) -> dict[str, Any]:
    coll = collection_arg(ctx)
    statements = _statements(ctx, "updates", ("q", "u"))
    ordered = ctx.body.get("ordered", True) is not False
    unit = WriteUnit.open(ctx)
    stmt_ids = unit.statement_ids(len(statements))
    n = n_modified = 0
    upserted: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for i, stmt in enumerate(statements):

        def run(stmt: dict[str, Any] = stmt) -> UpdateResult:
            if unit.retry is not None and stmt.get("multi"):
                raise CommandError(72, _MULTI_RETRY_ERROR.format("multi=true"))
            return update_statement(ctx, unit, ctx.db, coll, stmt)

        try:
            matched, modified, upserted_id = run_statement(unit, stmt_ids[i], run)
        except (CommandError, DuplicateKey) as err:
            if unit.in_transaction:
                unit.fail()
                raise as_command_error(err) from None
            errors.append(write_error(i, err))
            if ordered:
                break
            continue
        n += matched
        n_modified += modified
        if upserted_id is not None:
            upserted.append({"index": i, "_id": upserted_id[0]})
    tail: dict[str, Any] = {}
    if upserted:
        tail["upserted"] = upserted
    tail["nModified"] = n_modified
    return _write_reply(ctx, unit, n, errors, **tail)


def delete_statement(
    ctx: CommandContext, unit: WriteUnit, db: str, coll: str, query: dict[str, Any], limit: int
) -> int:
    """Delete the first (``limit`` 1) or every (0) document matching ``query``; return how many."""
    state = check_writable(ctx, db, coll)
    targets = matching(state, query, limit=limit)
    for doc in targets:
        assert state is not None
        _delete_document(unit, state, doc)
    return len(targets)


@command("delete", write=True)
def delete(ctx: CommandContext) -> dict[str, Any]:
    coll = collection_arg(ctx)
    statements = _statements(ctx, "deletes", ("q", "limit"))
    for stmt in statements:
        limit = stmt["limit"]
        if limit not in (0, 1) or isinstance(limit, bool):
            raise CommandError(9, f"The limit field in delete objects must be 0 or 1. Got {limit}")
    ordered = ctx.body.get("ordered", True) is not False
    unit = WriteUnit.open(ctx)
    stmt_ids = unit.statement_ids(len(statements))
    n = 0
    errors: list[dict[str, Any]] = []
    for i, stmt in enumerate(statements):

        def run(stmt: dict[str, Any] = stmt) -> int:
            query = query_arg(stmt.get("q"), "delete.deletes.q")
            if unit.retry is not None and stmt["limit"] == 0:
                raise CommandError(72, _MULTI_RETRY_ERROR.format("limit=0"))
            return delete_statement(ctx, unit, ctx.db, coll, query, int(stmt["limit"]))

        try:
            n += run_statement(unit, stmt_ids[i], run)
        except CommandError as err:
            if unit.in_transaction:
                unit.fail()
                raise
            errors.append(write_error(i, err))
            if ordered:
                break
    return _write_reply(ctx, unit, n, errors)


# ======================================================================================
# findAndModify
# ======================================================================================


@command("findAndModify", "findandmodify", write=True)
def find_and_modify(ctx: CommandContext) -> dict[str, Any]:
    coll = collection_arg(ctx)
    body = ctx.body
    query = query_arg(body.get("query"), "findAndModify.query")
    remove = bool(body.get("remove", False))
    spec = body.get("update")
    new = bool(body.get("new", False))
    upsert = bool(body.get("upsert", False))
    fields = query_arg(body.get("fields"), "findAndModify.fields")
    if remove and spec is not None:
        raise CommandError(9, "Cannot specify both an update and remove=true")
    if not remove and spec is None:
        raise CommandError(9, "Either an update or remove=true must be specified")
    if remove and upsert:
        raise CommandError(9, "Cannot specify both upsert=true and remove=true")
    if remove and new:
        raise CommandError(
            9,
            "Cannot specify both new=true and remove=true; 'remove' always returns the deleted "
            "document",
        )
    unit = WriteUnit.open(ctx)
    (stmt_id,) = unit.statement_ids(1)
    try:
        leo, value = run_statement(
            unit,
            stmt_id,
            lambda: _find_and_modify(
                ctx, unit, coll, query, spec, remove=remove, new=new, upsert=upsert
            ),
        )
    except (CommandError, DuplicateKey) as err:
        unit.fail()
        raise as_command_error(err) from None
    reply = {"lastErrorObject": leo, "value": project(value, fields) if value and fields else value}
    if unit.retried and ctx.deployment.profile.retried_stmt_ids:
        reply["retriedStmtId"] = stmt_id
    return reply


def _find_and_modify(
    ctx: CommandContext,
    unit: WriteUnit,
    coll: str,
    query: dict[str, Any],
    spec: Any,
    *,
    remove: bool,
    new: bool,
    upsert: bool,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    state = check_writable(ctx, ctx.db, coll)
    sort = query_arg(ctx.body.get("sort"), "findAndModify.sort")
    targets = sorted_documents(matching(state, query, limit=0 if sort else 1), sort)
    old = targets[0] if targets else None
    if remove:
        if old is None:
            return {"n": 0}, None
        assert state is not None
        _delete_document(unit, state, old)
        return {"n": 1}, copy_value(old)
    update = Update(spec, array_filters=ctx.body.get("arrayFilters"))
    if old is not None:
        assert state is not None
        outcome = update.apply(old, _env(ctx), query=query)
        if outcome.oplog_o is not None:
            _validate(ctx, state, outcome.doc, old)
            _store_update(unit, state, old, outcome)
        return {"n": 1, "updatedExisting": True}, copy_value(outcome.doc if new else old)
    if not upsert:
        return {"n": 0, "updatedExisting": False}, None
    doc = _upsert(ctx, unit, ctx.db, coll, update, query)
    leo = {"n": 1, "updatedExisting": False, "upserted": doc["_id"]}
    return leo, copy_value(doc) if new else None
