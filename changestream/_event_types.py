"""The typed change events' declarations: immutable dataclasses, one per ``operationType``.

Declarations only (fields, types, defaults, ``match`` arguments); how documents
and raw BSON become events is :mod:`changestream._event_build`, and the public
face of both is :mod:`changestream.events`, which documents the behaviour.
A deferred event (see :class:`_Deferrable`) is filled on its first field read
by the function it carries, so this module imports nothing of the client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Final
from uuid import UUID

from bson.binary import Binary
from bson.datetime_ms import DatetimeMS
from bson.timestamp import Timestamp

__all__ = [
    "ChangeEvent",
    "CreateEvent",
    "CreateIndexesEvent",
    "DeleteEvent",
    "DropDatabaseEvent",
    "DropEvent",
    "DropIndexesEvent",
    "InsertEvent",
    "InvalidateEvent",
    "ModifyEvent",
    "Namespace",
    "OperationType",
    "RefineCollectionShardKeyEvent",
    "RenameEvent",
    "ReplaceEvent",
    "ReshardCollectionEvent",
    "ShardCollectionEvent",
    "SplitEvent",
    "TruncatedArray",
    "UnknownEvent",
    "UpdateDescription",
    "UpdateEvent",
    "event_namespace",
]


class _ReadOnlyMapping(Mapping[str, Any]):
    """Immutable view used for ``extra``: unlike MappingProxyType it pickles and deep-copies,
    so events survive ``pickle``, ``copy.deepcopy`` and ``dataclasses.asdict``."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[type[_ReadOnlyMapping], tuple[dict[str, Any]]]:
        return type(self), (dict(self._data),)


_EMPTY: Final[Mapping[str, Any]] = _ReadOnlyMapping({})


def _empty() -> Mapping[str, Any]:
    """Default factory: a Mapping is unhashable, so dataclasses refuse it as a plain default."""
    return _EMPTY


class OperationType(str, Enum):
    """The ``operationType`` values this module models; others parse to :class:`UnknownEvent`."""

    INSERT = "insert"
    UPDATE = "update"
    REPLACE = "replace"
    DELETE = "delete"
    DROP = "drop"
    RENAME = "rename"
    DROP_DATABASE = "dropDatabase"
    INVALIDATE = "invalidate"
    CREATE = "create"
    CREATE_INDEXES = "createIndexes"
    DROP_INDEXES = "dropIndexes"
    MODIFY = "modify"
    SHARD_COLLECTION = "shardCollection"
    RESHARD_COLLECTION = "reshardCollection"
    REFINE_COLLECTION_SHARD_KEY = "refineCollectionShardKey"

    def __str__(self) -> str:
        """The server's spelling, so f-strings and logs show ``insert``, not ``OperationType.INSERT``."""
        return str.__str__(self)


# --------------------------------------------------------------------------- supporting types


@dataclass(frozen=True, slots=True, kw_only=True)
class Namespace:
    """``ns``/``to``: ``coll`` is None for dropDatabase; unknown keys are kept in ``extra``."""

    __match_args__ = ("db", "coll")

    db: str
    coll: str | None = None
    extra: Mapping[str, Any] = field(default_factory=_empty)

    @property
    def full_name(self) -> str:
        """``"db.coll"``, or just ``"db"`` for a database-level namespace."""
        return self.db if self.coll is None else f"{self.db}.{self.coll}"


@dataclass(frozen=True, slots=True, kw_only=True)
class TruncatedArray:
    """An array field the update shortened to ``new_size`` elements."""

    __match_args__ = ("field", "new_size")

    field: str
    new_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateDescription:
    """``updateDescription`` of an update event.

    ``truncated_arrays`` is None on servers before 5.0 (no such key);
    ``disambiguated_paths`` is None unless the server sent it (showExpandedEvents).
    Unknown keys and values of unexpected types are kept in ``extra``.
    """

    __match_args__ = ("updated_fields", "removed_fields", "truncated_arrays", "disambiguated_paths")

    updated_fields: Mapping[str, Any] = field(default_factory=_empty)
    removed_fields: tuple[str, ...] = ()
    truncated_arrays: tuple[TruncatedArray, ...] | None = None
    disambiguated_paths: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=_empty)


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitEvent:
    """``splitEvent`` of a ``$changeStreamSplitLargeEvent`` fragment (1-based ``fragment`` of ``of``)."""

    __match_args__ = ("fragment", "of")

    fragment: int
    of: int


# --------------------------------------------------------------------------- events


class _Deferrable:
    """Holds what a deferred event is filled from on its first field read.

    ``_pending`` is ``(source, fill)`` until the first read of any field calls
    ``fill(event, source)``, which sets every slot and ``_pending`` to ``None``;
    unset for events built by their constructor. Not a dataclass field:
    ``fields()``, equality, ``repr`` and pickling never see it.
    """

    __slots__ = ("_pending",)


_pending_of: Final[Callable[[_Deferrable], tuple[Any, Callable[[Any, Any], Any]] | None]] = (
    _Deferrable._pending.__get__  # type: ignore[attr-defined]
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChangeEvent(_Deferrable):
    """Fields every change event may carry; absent ones are None.

    ``resume_token`` is the ``_id`` mapping exactly as received (never re-encoded).
    ``extra`` holds every top-level field the class does not model or whose value
    had an unexpected type; ``raw`` is the original document object (not compared,
    not in ``repr``). ``wall_time`` is a ``DatetimeMS`` when the codec asks for one.
    ``collection_uuid`` (``collectionUUID``) comes with showExpandedEvents;
    ``commit_timestamp`` (``commitTimestamp``, a Timestamp) only on CRUD events of a
    prepared (cross-shard) transaction when the server was asked for it.
    ``ns`` lives here because every type but ``invalidate`` carries it, so code can
    read a namespace without knowing the event type. Events are not mappings: use
    ``raw`` for key access.
    """

    __match_args__: ClassVar[tuple[str, ...]] = ("operation_type",)

    resume_token: Mapping[str, Any] | None
    operation_type: str
    cluster_time: Timestamp | None = None
    wall_time: datetime | DatetimeMS | None = None
    ns: Namespace | None = None
    txn_number: int | None = None
    lsid: Mapping[str, Any] | None = None
    collection_uuid: UUID | Binary | None = None
    split_event: SplitEvent | None = None
    commit_timestamp: Timestamp | None = None
    extra: Mapping[str, Any] = field(default_factory=_empty)
    raw: Mapping[str, Any] = field(default_factory=_empty, repr=False, compare=False)

    if not TYPE_CHECKING:  # mypy would otherwise accept any attribute name on events

        def __getattr__(self, name: str) -> Any:
            """Reached only for an unset slot: fill a deferred event, then read again."""
            try:
                pending = _pending_of(self)
            except AttributeError:  # never deferred: an event built by its constructor
                pending = None
            if pending is None or name[:2] == "__":
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            pending[1](self, pending[0])
            return object.__getattribute__(self, name)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertEvent(ChangeEvent):
    """A document was inserted (also an upsert that inserted)."""

    __match_args__ = ("full_document", "document_key", "ns")

    document_key: Mapping[str, Any] | None = None
    full_document: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateEvent(ChangeEvent):
    """A document was updated in place; ``full_document`` only with a post-image option."""

    __match_args__ = ("update_description", "document_key", "ns")

    document_key: Mapping[str, Any] | None = None
    update_description: UpdateDescription | None = None
    full_document: Mapping[str, Any] | None = None
    full_document_before_change: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplaceEvent(ChangeEvent):
    """A document was replaced as a whole."""

    __match_args__ = ("full_document", "document_key", "ns")

    document_key: Mapping[str, Any] | None = None
    full_document: Mapping[str, Any] | None = None
    full_document_before_change: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteEvent(ChangeEvent):
    """A document was deleted; ``full_document_before_change`` only with a pre-image option."""

    __match_args__ = ("document_key", "ns")

    document_key: Mapping[str, Any] | None = None
    full_document_before_change: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DropEvent(ChangeEvent):
    """A collection was dropped."""

    __match_args__ = ("ns",)


@dataclass(frozen=True, slots=True, kw_only=True)
class RenameEvent(ChangeEvent):
    """A collection was renamed from ``ns`` to ``to``."""

    __match_args__ = ("ns", "to")

    to: Namespace | None = None
    operation_description: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DropDatabaseEvent(ChangeEvent):
    """A database was dropped (``ns.coll`` is None)."""

    __match_args__ = ("ns",)


@dataclass(frozen=True, slots=True, kw_only=True)
class InvalidateEvent(ChangeEvent):
    """The stream was invalidated; its ``resume_token`` is usable with ``start_after``."""

    __match_args__ = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateEvent(ChangeEvent):
    """A collection or view was created (showExpandedEvents); ``ns_type`` on 8.1+."""

    __match_args__ = ("ns", "operation_description")

    operation_description: Mapping[str, Any] | None = None
    ns_type: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class _DescribedEvent(ChangeEvent):
    """A DDL event whose details are all in ``operation_description``."""

    __match_args__ = ("ns", "operation_description")

    operation_description: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateIndexesEvent(_DescribedEvent):
    """Indexes were created (showExpandedEvents)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DropIndexesEvent(_DescribedEvent):
    """Indexes were dropped (showExpandedEvents)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModifyEvent(ChangeEvent):
    """``collMod`` changed a collection (showExpandedEvents)."""

    __match_args__ = ("ns", "operation_description")

    operation_description: Mapping[str, Any] | None = None
    state_before_change: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardCollectionEvent(_DescribedEvent):
    """A collection was sharded (showExpandedEvents)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardCollectionEvent(_DescribedEvent):
    """A collection was resharded (showExpandedEvents)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RefineCollectionShardKeyEvent(_DescribedEvent):
    """A shard key was refined (showExpandedEvents)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownEvent(ChangeEvent):
    """An ``operationType`` this version does not know; ``operation_type`` is the raw string.

    Also how an ``operationType: "error"`` document arrives (reported for MongoDB 9.1,
    not in mongod's source as of this writing): its fields are not modelled, they stay
    in ``extra`` and ``raw``; ``consume`` never hands it to the handler as data.
    """

    __match_args__ = ("operation_type", "ns")


_EVENT_CLASSES: Final[Mapping[OperationType, type[ChangeEvent]]] = {
    OperationType.INSERT: InsertEvent,
    OperationType.UPDATE: UpdateEvent,
    OperationType.REPLACE: ReplaceEvent,
    OperationType.DELETE: DeleteEvent,
    OperationType.DROP: DropEvent,
    OperationType.RENAME: RenameEvent,
    OperationType.DROP_DATABASE: DropDatabaseEvent,
    OperationType.INVALIDATE: InvalidateEvent,
    OperationType.CREATE: CreateEvent,
    OperationType.CREATE_INDEXES: CreateIndexesEvent,
    OperationType.DROP_INDEXES: DropIndexesEvent,
    OperationType.MODIFY: ModifyEvent,
    OperationType.SHARD_COLLECTION: ShardCollectionEvent,
    OperationType.RESHARD_COLLECTION: ReshardCollectionEvent,
    OperationType.REFINE_COLLECTION_SHARD_KEY: RefineCollectionShardKeyEvent,
}


def event_namespace(event: ChangeEvent) -> str | None:
    """``"db.coll"`` (``"db"`` for dropDatabase) of an event, None when it has no usable ``ns``."""
    ns = event.ns
    return None if ns is None else ns.full_name



# Every class is documented, pickled and shown as part of the public module.
for _cls in (_ReadOnlyMapping, Namespace, TruncatedArray, UpdateDescription, SplitEvent, ChangeEvent,
             *_EVENT_CLASSES.values(), UnknownEvent, OperationType):
    _cls.__module__ = "changestream.events"
del _cls
