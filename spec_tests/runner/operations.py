"""Entity and testRunner operations, and the per-operation assertions.

Each handler takes the test context, the entity and the operation's
arguments (an :class:`Args`, which refuses unknown arguments). Change
streams are opened through :func:`.adapter.open_change_stream`; everything
else goes through PyMongo directly.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bson import decode
from bson.raw_bson import RawBSONDocument
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.results import DeleteResult, InsertOneResult, UpdateResult

from . import RunnerError, SpecFailure
from .adapter import open_change_stream
from .entities import ClientEntity, EntityMap, read_preference
from .errors import check_expected_error, describe
from .matcher import MatchError, match
from .targets import Target

ITERATION_LIMIT_S = 20.0
"""iterateUntilDocumentOrError gives up (closing the stream) after this long."""


@dataclass
class TestContext:
    """State of one running test that operations read and extend."""

    target: Target
    entities: EntityMap
    client_impl: str
    failpoints: list[tuple[ClientEntity, str]] = field(default_factory=list)
    namespaces: set[tuple[str, str]] = field(default_factory=set)
    """(database, collection) pairs the test touched; dropped afterwards."""


class Args:
    """An operation's arguments; every one must be consumed (unknown ones are errors)."""

    def __init__(self, operation: str, arguments: Mapping[str, Any]) -> None:
        self.operation = operation
        self._args = dict(arguments)

    def required(self, key: str) -> Any:
        if key not in self._args:
            raise RunnerError(f"{self.operation}: missing required argument {key!r}")
        return self._args.pop(key)

    def optional(self, key: str, default: Any = None) -> Any:
        return self._args.pop(key, default)

    def options(self, names: Mapping[str, str]) -> dict[str, Any]:
        """Consume the present optional arguments, renamed per ``names``."""
        return {names[k]: self._args.pop(k) for k in list(self._args) if k in names}

    def everything(self) -> dict[str, Any]:
        rest, self._args = self._args, {}
        return rest

    def done(self) -> None:
        if "session" in self._args:
            raise RunnerError(f"{self.operation}: session entities are not supported")
        if self._args:
            raise RunnerError(f"{self.operation}: unsupported arguments {sorted(self._args)}")


Handler = Callable[[TestContext, Any, Args], Any]


# -- change streams -------------------------------------------------------------
class StreamExhausted(Exception):
    """next() ended the iteration: the change stream is closed (e.g. invalidated)."""


def create_change_stream(ctx: TestContext, target: Any, args: Args) -> Any:
    arguments = args.everything()
    if "session" in arguments:
        raise RunnerError("createChangeStream: session entities are not supported")
    client = target.client if isinstance(target, ClientEntity) else target
    stream = open_change_stream(client, arguments, ctx.client_impl, ctx.entities.bridge)
    ctx.entities.track_stream(stream)
    return stream


def _plain(doc: Any) -> Any:
    if isinstance(doc, RawBSONDocument):
        return decode(doc.raw)
    return doc


def next_with_limit(stream: Any, limit_s: float = ITERATION_LIMIT_S) -> Any:
    """``stream.next()``, but the stream is closed from a timer after ``limit_s``.

    A blocking ``next()`` would otherwise hang forever if no event ever comes.
    """
    gave_up = threading.Event()

    def give_up() -> None:
        gave_up.set()
        with contextlib.suppress(Exception):
            stream.close()

    timer = threading.Timer(limit_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        return _plain(stream.next())
    except StopIteration:
        if gave_up.is_set():
            raise RunnerError(f"no change event within {limit_s:.0f} s") from None
        raise StreamExhausted("next() raised StopIteration: the change stream is closed") from None
    except Exception:
        if gave_up.is_set():
            raise RunnerError(f"no change event within {limit_s:.0f} s") from None
        raise
    finally:
        timer.cancel()


def iterate_until_document_or_error(ctx: TestContext, stream: Any, args: Args) -> Any:
    args.done()
    return next_with_limit(stream)


def iterate_once(ctx: TestContext, stream: Any, args: Args) -> Any:
    args.done()
    return _plain(stream.try_next())


def close_stream(ctx: TestContext, stream: Any, args: Args) -> None:
    args.done()
    with contextlib.suppress(Exception):  # spec: suppress all errors when closing
        stream.close()


# -- clients ----------------------------------------------------------------------
def close_client(ctx: TestContext, client: ClientEntity, args: Args) -> None:
    args.done()
    client.close()


# -- databases ---------------------------------------------------------------------
def run_command(ctx: TestContext, db: Database[Any], args: Args) -> Any:
    command = args.required("command")
    name = args.required("commandName")
    pref = args.optional("readPreference")
    args.done()
    if next(iter(command), None) != name:
        raise RunnerError(f"runCommand: commandName {name!r} is not the first key of {command}")
    kwargs = {"read_preference": read_preference(pref)} if pref else {}
    _touch_command(ctx, db.name, command)
    return db.command(command, **kwargs)


def _touch_command(ctx: TestContext, db_name: str, command: Mapping[str, Any]) -> None:
    """Remember namespaces that DDL commands create, for cleanup."""
    name, value = next(iter(command.items()))
    if name in ("create", "collMod") and isinstance(value, str):
        ctx.namespaces.add((db_name, value))
    elif name == "renameCollection" and isinstance(command.get("to"), str):
        db, _, coll = command["to"].partition(".")
        ctx.namespaces.add((db, coll))


_CREATE_OPTIONS = frozenset(
    {
        "viewOn",
        "pipeline",
        "changeStreamPreAndPostImages",
        "capped",
        "size",
        "max",
        "validator",
        "validationLevel",
        "validationAction",
        "timeseries",
        "expireAfterSeconds",
        "clusteredIndex",
        "collation",
        "storageEngine",
        "indexOptionDefaults",
    }
)


def create_collection(ctx: TestContext, db: Database[Any], args: Args) -> Any:
    name = args.required("collection")
    options = args.options({k: k for k in _CREATE_OPTIONS})
    args.done()
    ctx.namespaces.add((db.name, name))
    return db.create_collection(name, check_exists=False, **options)


def drop_collection(ctx: TestContext, db: Database[Any], args: Args) -> Any:
    name = args.required("collection")
    args.done()
    return db.drop_collection(name)


# -- collections -----------------------------------------------------------------
_WRITE_OPTIONS = {
    "comment": "comment",
    "bypassDocumentValidation": "bypass_document_validation",
}
_UPDATE_OPTIONS = {
    **_WRITE_OPTIONS,
    "upsert": "upsert",
    "collation": "collation",
    "hint": "hint",
    "let": "let",
    "sort": "sort",
}


def _insert_result(result: InsertOneResult) -> dict[str, Any]:
    return {"insertedId": result.inserted_id}


def _update_result(result: UpdateResult) -> dict[str, Any]:
    doc = {
        "matchedCount": result.matched_count,
        "modifiedCount": result.modified_count,
        "upsertedCount": 0 if result.upserted_id is None else 1,
    }
    if result.upserted_id is not None:
        doc["upsertedId"] = result.upserted_id
    return doc


def _delete_result(result: DeleteResult) -> dict[str, Any]:
    return {"deletedCount": result.deleted_count}


def insert_one(ctx: TestContext, coll: Collection[Any], args: Args) -> Any:
    document = args.required("document")
    options = args.options(_WRITE_OPTIONS)
    args.done()
    return _insert_result(coll.insert_one(document, **options))


def update_one(ctx: TestContext, coll: Collection[Any], args: Args) -> Any:
    query = args.required("filter")
    update = args.required("update")
    options = args.options({**_UPDATE_OPTIONS, "arrayFilters": "array_filters"})
    args.done()
    return _update_result(coll.update_one(query, update, **options))


def replace_one(ctx: TestContext, coll: Collection[Any], args: Args) -> Any:
    query = args.required("filter")
    replacement = args.required("replacement")
    options = args.options(_UPDATE_OPTIONS)
    args.done()
    return _update_result(coll.replace_one(query, replacement, **options))


def delete_one(ctx: TestContext, coll: Collection[Any], args: Args) -> Any:
    query = args.required("filter")
    options = args.options(
        {"comment": "comment", "collation": "collation", "hint": "hint", "let": "let"}
    )
    args.done()
    return _delete_result(coll.delete_one(query, **options))


_INDEX_OPTIONS = frozenset(
    {
        "unique",
        "sparse",
        "expireAfterSeconds",
        "partialFilterExpression",
        "collation",
        "hidden",
        "wildcardProjection",
        "comment",
    }
)


def create_index(ctx: TestContext, coll: Collection[Any], args: Args) -> Any:
    keys = args.required("keys")
    options = args.options({"name": "name", **{k: k for k in _INDEX_OPTIONS}})
    args.done()
    return coll.create_index(list(keys.items()), **options)


def drop_index(ctx: TestContext, coll: Collection[Any], args: Args) -> Any:
    name = args.required("name")
    options = args.options({"comment": "comment"})
    args.done()
    return coll.drop_index(name, **options)


def rename(ctx: TestContext, coll: Collection[Any], args: Args) -> Any:
    to = args.required("to")
    options = args.options({"dropTarget": "dropTarget", "comment": "comment"})
    args.done()
    ctx.namespaces.add((coll.database.name, to))
    return coll.rename(to, **options)


# -- testRunner ---------------------------------------------------------------------
def fail_point(ctx: TestContext, _: Any, args: Args) -> None:
    client = ctx.entities.client(args.required("client"))
    command = args.required("failPoint")
    args.done()
    if next(iter(command), None) != "configureFailPoint":
        raise RunnerError(f"failPoint: not a configureFailPoint command: {command}")
    client.client.admin.command(command)
    ctx.failpoints.append((client, command["configureFailPoint"]))


def create_entities(ctx: TestContext, _: Any, args: Args) -> None:
    entities = args.required("entities")
    args.done()
    ctx.entities.create(entities)


HANDLERS: dict[tuple[str, str], Handler] = {
    ("client", "createChangeStream"): create_change_stream,
    ("client", "close"): close_client,
    ("database", "createChangeStream"): create_change_stream,
    ("database", "runCommand"): run_command,
    ("database", "createCollection"): create_collection,
    ("database", "dropCollection"): drop_collection,
    ("collection", "createChangeStream"): create_change_stream,
    ("collection", "insertOne"): insert_one,
    ("collection", "updateOne"): update_one,
    ("collection", "replaceOne"): replace_one,
    ("collection", "deleteOne"): delete_one,
    ("collection", "createIndex"): create_index,
    ("collection", "dropIndex"): drop_index,
    ("collection", "rename"): rename,
    ("changeStream", "iterateUntilDocumentOrError"): iterate_until_document_or_error,
    ("changeStream", "iterateOnce"): iterate_once,
    ("changeStream", "close"): close_stream,
    ("testRunner", "failPoint"): fail_point,
    ("testRunner", "createEntities"): create_entities,
}

_OPERATION_KEYS = frozenset(
    {
        "name",
        "object",
        "arguments",
        "expectError",
        "expectResult",
        "saveResultAsEntity",
        "ignoreResultAndError",
    }
)


def run_operation(ctx: TestContext, operation: dict[str, Any], index: int) -> None:
    """Execute one operation and check its result or error."""
    unknown = set(operation) - _OPERATION_KEYS
    if unknown:
        raise RunnerError(f"operation {index}: unsupported keys {sorted(unknown)}")
    name, obj = operation["name"], operation["object"]
    where = f"operation {index} ({name} on {obj})"
    if obj == "testRunner":
        kind, target = "testRunner", None
    else:
        kind = ctx.entities.kind_of(obj)
        target = ctx.entities.entity(obj)
    handler = HANDLERS.get((kind, name))
    if handler is None:
        raise RunnerError(f"{where}: unsupported operation {name!r} for a {kind}")
    args = Args(name, copy.deepcopy(operation.get("arguments", {})))
    try:
        result = handler(ctx, target, args)
        error: BaseException | None = None
    except RunnerError as exc:
        raise RunnerError(f"{where}: {exc}") from exc
    except SpecFailure:
        raise
    except Exception as exc:
        result, error = None, exc
    if operation.get("ignoreResultAndError"):
        return
    if "expectError" in operation:
        if error is None:
            raise SpecFailure(f"{where}: expected an error, got result {result!r}")
        try:
            check_expected_error(operation["expectError"], error, ctx.entities)
        except SpecFailure as exc:
            raise SpecFailure(f"{where}: {exc}") from error
        return
    if error is not None:
        raise SpecFailure(f"{where}: unexpected error {describe(error)}") from error
    if "expectResult" in operation:
        try:
            match(
                operation["expectResult"], result, root=True, entities=ctx.entities, path="result"
            )
        except MatchError as exc:
            raise SpecFailure(f"{where}: {exc}") from None
    if "saveResultAsEntity" in operation:
        if result is None:
            raise SpecFailure(f"{where}: no result to save as {operation['saveResultAsEntity']!r}")
        ctx.entities.save_result(operation["saveResultAsEntity"], result)
