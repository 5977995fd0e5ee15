"""Typed change events: immutable dataclasses parsed from raw change-stream documents.

One frozen, slotted dataclass per ``operationType`` so applications can use
``match``/``isinstance`` instead of string keys. Parsing is forward compatible
and lossless: an unknown ``operationType`` becomes :class:`UnknownEvent`, every
top-level field a class does not model (or whose value has an unexpected type)
is kept in ``extra``, and ``raw`` is the original document object. Documents
that no longer look like events (a user ``$project`` dropped or renamed
``operationType``) are returned unchanged. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Final, NamedTuple, TypeVar
from uuid import UUID

from bson.binary import Binary
from bson.datetime_ms import DatetimeMS
from bson.int64 import Int64
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from bson.timestamp import Timestamp

__all__ = [
    "ChangeEvent",
    "CreateEvent",
    "CreateIndexesEvent",
    "DeleteEvent",
    "DropDatabaseEvent",
    "DropEvent",
    "DropIndexesEvent",
    "EventParser",
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
    "parse_event",
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
    """Holds what a deferred event is parsed from on first read (see :class:`EventParser`).

    ``_pending`` is ``(document, parser)`` until the first read of any field
    parses the whole document into every slot at once, then ``None``; unset
    for events built by their constructor. Not a dataclass field: ``fields()``,
    equality, ``repr`` and pickling never see it.
    """

    __slots__ = ("_pending",)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChangeEvent(_Deferrable):
    """Fields every change event may carry; absent ones are None.

    ``resume_token`` is the ``_id`` mapping exactly as received (never re-encoded).
    ``extra`` holds every top-level field the class does not model or whose value
    had an unexpected type; ``raw`` is the original document object (not compared,
    not in ``repr``). ``wall_time`` is a ``DatetimeMS`` when the codec asks for one.
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
    extra: Mapping[str, Any] = field(default_factory=_empty)
    raw: Mapping[str, Any] = field(default_factory=_empty, repr=False, compare=False)

    if not TYPE_CHECKING:  # mypy would otherwise accept any attribute name on events

        def __getattr__(self, name: str) -> Any:
            """Reached only for an unset slot: parse a deferred event, then read again."""
            try:
                pending = _read_pending(self)
            except AttributeError:  # never deferred: an event built by its constructor
                pending = None
            if pending is None or name[:2] == "__":
                raise AttributeError(
                    f"{type(self).__name__!r} object has no attribute {name!r}"
                )
            _FILLERS[type(self)](self, pending[0])
            pending[1].filled += 1
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
    """An ``operationType`` this version does not know; ``operation_type`` is the raw string."""

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


# --------------------------------------------------------------------------- field coercion
#
# A coercer gets a non-null value whose exact type is not in the field's
# fast-path set and returns the value to store, or _BAD: the field then keeps its
# default and the value goes to ``extra``.

_BAD: Final = object()
_Coerce = Callable[[Any], Any]

_MAPPING_TYPES: Final = frozenset({dict, SON, RawBSONDocument})
_NO_TYPES: Final[frozenset[type]] = frozenset()


def _mapping(value: Any) -> Any:
    return value if isinstance(value, Mapping) else _BAD


def _string(value: Any) -> Any:
    return value if isinstance(value, str) else _BAD


def _timestamp(value: Any) -> Any:
    return value if isinstance(value, Timestamp) else _BAD


def _wall_time(value: Any) -> Any:
    return value if isinstance(value, (datetime, DatetimeMS)) else _BAD


def _integer(value: Any) -> Any:
    return value if isinstance(value, int) and not isinstance(value, bool) else _BAD


def _uuid(value: Any) -> Any:
    return value if isinstance(value, (UUID, Binary)) else _BAD


def _removed_fields(value: Any) -> Any:
    if type(value) is not list and not isinstance(value, tuple):
        return _BAD
    for name in value:
        if type(name) is not str and not isinstance(name, str):
            return _BAD
    return tuple(value)


def _extra(
    source: Mapping[str, Any], known: frozenset[str], bad: list[str] | None
) -> Mapping[str, Any]:
    """Read-only copy of the entries of ``source`` that are unmodelled or were unusable."""
    rejected = () if bad is None else bad
    extra = {k: v for k, v in source.items() if k not in known or k in rejected}
    return _ReadOnlyMapping(extra) if extra else _EMPTY


# --------------------------------------------------------------------------- compiled readers

_T = TypeVar("_T")


class _Field(NamedTuple):
    """How one server key maps to one attribute."""

    key: str
    attr: str
    fast: frozenset[type]  # exact types stored as they are, without calling ``coerce``
    coerce: _Coerce
    default: Any = None  # stored when the key is absent, null or unusable


def _compile(
    cls: type[_T],
    params: Sequence[str],
    body: Sequence[str],
    assigned: Iterable[str],
    env: Mapping[str, Any],
    *,
    prologue: Sequence[str] = (),
    in_place: bool = False,
) -> Callable[..., _T]:
    """Compile a function that fills the slots of a ``cls`` by running ``body`` on ``self``.

    By default ``build(*params)`` makes a new instance; with ``in_place``,
    ``fill(self, *params)`` sets the slots of an existing one (a deferred event)
    and returns it. ``prologue`` runs before ``self`` is touched.

    A frozen dataclass ``__init__`` sets every field through ``object.__setattr__``,
    about 150 ns per field (2 µs per event). Here ``self`` is (or temporarily
    becomes) an instance of a private subclass that adds no slots and keeps plain
    attribute assignment; once filled, its ``__class__`` becomes ``cls`` (same
    memory layout). That is ~5x faster, and straight-line code avoids per-field
    loop overhead. Users still get the ordinary dataclass constructor. ``assigned``
    (the attributes ``body`` sets) is checked against the dataclass fields so no
    slot is ever left unset.
    """
    missing = {f.name for f in fields(cls)} - set(assigned)  # type: ignore[arg-type]
    if missing:
        raise TypeError(f"compiled constructor for {cls.__name__} never sets {sorted(missing)}")
    twin = _TWINS.get(cls)
    if twin is None:
        twin = _TWINS[cls] = type(
            f"_{cls.__name__}Builder",
            (cls,),
            {"__slots__": (), "__setattr__": object.__setattr__,
             "__delattr__": object.__delattr__},
        )
    if in_place:
        head = [f"def fill({', '.join(['self', *params])}):",
                *(f"    {line}" for line in prologue),
                "    _setattr(self, '__class__', _twin)"]
        tail = ["    self._pending = None"]
    else:
        head = [f"def build({', '.join(params)}):",
                *(f"    {line}" for line in prologue), "    self = _new(_twin)"]
        tail = []
    lines = [
        *head,
        *(f"    {line}" for line in body),
        *tail,
        "    self.__class__ = _cls",
        "    return self",
    ]
    namespace: dict[str, Any] = {
        **env, "_new": object.__new__, "_setattr": object.__setattr__, "_twin": twin, "_cls": cls
    }
    exec("\n".join(lines), namespace)
    function: Callable[..., _T] = namespace["fill" if in_place else "build"]
    return function


_TWINS: Final[dict[type, type]] = {}


def _fast_constructor(cls: type[_T], names: Sequence[str]) -> Callable[..., _T]:
    """``build(*values)`` for ``cls`` with ``names`` given positionally."""
    return _compile(cls, names, [f"self.{name} = {name}" for name in names], names, {})


def _compile_reader(
    cls: type[_T],
    main: Sequence[_Field],
    rare: Sequence[_Field] = (),
    *,
    consumed: frozenset[str] = frozenset(),
    fixed: Mapping[str, str] | None = None,
    params: Sequence[str] | None = None,
    prologue: Sequence[str] = (),
    env: Mapping[str, Any] | None = None,
    in_place: bool = False,
) -> Callable[..., _T]:
    """Compile ``read(source, get, *fixed parameters)`` that parses a mapping into a ``cls``.

    ``params``, ``prologue``, ``env`` and ``in_place`` are passed to :func:`_compile`
    for other signatures (``prologue`` must then bind ``source``, ``get`` and the
    ``fixed`` parameters).

    ``main`` fields are always looked up; ``rare`` ones only when ``source`` has keys
    that the non-null ``main`` values and the caller's ``consumed`` keys do not account
    for, which skips four lookups on nearly every event. Only then is ``extra`` built
    (unmodelled or unusable entries; a null value counts as absent). ``fixed`` maps
    attributes to extra parameters stored as they are. Per field the generated code is::

        value = get(key)
        if value is None: value = default
        else:
            present += 1
            if type(value) not in fast:
                value = coerce(value)
                if value is _BAD: bad = [..., key]; value = default
        self.attr = value
    """
    fixed = fixed or {}
    names: dict[str, Any] = {
        **(env or {}),
        "_BAD": _BAD,
        "_EMPTY": _EMPTY,
        "_extra": _extra,
        "_known": frozenset(f.key for f in (*main, *rare)) | consumed,
    }

    def read_field(i: int, f: _Field) -> list[str]:
        names[f"_fast{i}"], names[f"_coerce{i}"], names[f"_default{i}"] = f.fast, f.coerce, f.default
        return [
            f"value = get({f.key!r})",
            "if value is None:",
            f"    value = _default{i}",
            "else:",
            "    present += 1",
            f"    if type(value) not in _fast{i}:",
            f"        value = _coerce{i}(value)",
            "        if value is _BAD:",
            f"            bad = [{f.key!r}] if bad is None else [*bad, {f.key!r}]",
            f"            value = _default{i}",
            f"self.{f.attr} = value",
        ]

    body = [f"present = {len(consumed)}", "bad = None"]
    for i, f in enumerate(main):
        body += read_field(i, f)
    body += ["if present == len(source) and bad is None:"]
    body += [f"    self.{f.attr} = _default{i}" for i, f in enumerate(rare, start=len(main))]
    body += ["    self.extra = _EMPTY", "else:"]
    for i, f in enumerate(rare, start=len(main)):
        body += [f"    {line}" for line in read_field(i, f)]
    body += [
        "    self.extra = _EMPTY if present == len(source) and bad is None"
        " else _extra(source, _known, bad)"
    ]
    body += [f"self.{attr} = {param}" for attr, param in fixed.items()]
    if params is None:
        params = ["source", "get", *fixed.values()]
    assigned = [*(f.attr for f in (*main, *rare)), "extra", *fixed]
    return _compile(cls, params, body, assigned, names, prologue=prologue, in_place=in_place)


# --------------------------------------------------------------------------- sub-documents

_new_namespace = _fast_constructor(Namespace, ("db", "coll", "extra"))
_new_truncated = _fast_constructor(TruncatedArray, ("field", "new_size"))
_new_split = _fast_constructor(SplitEvent, ("fragment", "of"))

_NS_CACHE: dict[tuple[str, str | None], Namespace] = {}
_NS_CACHE_LIMIT: Final = 1024


def _namespace(value: Any) -> Any:
    """``{db, coll?}`` → Namespace; a stream sees few namespaces, so plain ones are cached."""
    if type(value) is dict and len(value) == 2:
        # The usual ``{db, coll}`` seen before: a single lookup.
        try:
            return _NS_CACHE[value["db"], value["coll"]]
        except (KeyError, TypeError):
            pass
    if type(value) not in _MAPPING_TYPES and not isinstance(value, Mapping):
        return _BAD
    db, coll = value.get("db"), value.get("coll")
    try:
        cached = _NS_CACHE.get((db, coll))
    except TypeError:  # unhashable db/coll values: not a namespace we can cache
        cached = None
    if cached is not None and len(value) == (1 if coll is None else 2):
        return cached
    if not isinstance(db, str):
        return _BAD
    extra = {k: v for k, v in value.items() if k != "db" and k != "coll"}
    if coll is not None and not isinstance(coll, str):
        extra["coll"] = coll
        coll = None
    if extra:
        return _new_namespace(db, coll, _ReadOnlyMapping(extra))
    if len(_NS_CACHE) >= _NS_CACHE_LIMIT:
        _NS_CACHE.clear()
    namespace = _NS_CACHE[db, coll] = _new_namespace(db, coll, _EMPTY)
    return namespace


def _split_event(value: Any) -> Any:
    if not isinstance(value, Mapping):
        return _BAD
    fragment, of = value.get("fragment"), value.get("of")
    if _integer(fragment) is _BAD or _integer(of) is _BAD:
        return _BAD
    return _new_split(fragment, of)


def _truncated_arrays(value: Any) -> Any:
    if type(value) is not list and not isinstance(value, tuple):
        return _BAD
    if not value:
        return ()
    result = []
    for entry in value:
        if not isinstance(entry, Mapping):
            return _BAD
        name, size = entry.get("field"), entry.get("newSize")
        if not isinstance(name, str) or _integer(size) is _BAD:
            return _BAD
        result.append(_new_truncated(name, size))
    return tuple(result)


_read_update_description = _compile_reader(
    UpdateDescription,
    [
        _Field("updatedFields", "updated_fields", _MAPPING_TYPES, _mapping, _EMPTY),
        _Field("removedFields", "removed_fields", _NO_TYPES, _removed_fields, ()),
        _Field("truncatedArrays", "truncated_arrays", _NO_TYPES, _truncated_arrays),
        _Field("disambiguatedPaths", "disambiguated_paths", _MAPPING_TYPES, _mapping),
    ],
)


def _update_description(value: Any) -> Any:
    if type(value) is not dict:
        if not isinstance(value, Mapping):
            return _BAD
        value = dict(value.items())  # C-level lookups, as in parse_event
    return _read_update_description(value, value.get)


# --------------------------------------------------------------------------- events

# Every modelled event field, by attribute name.
_EVENT_FIELDS: Final[Mapping[str, _Field]] = {
    f.attr: f
    for f in (
        _Field("_id", "resume_token", _MAPPING_TYPES, _mapping),
        _Field("clusterTime", "cluster_time", frozenset({Timestamp}), _timestamp),
        _Field("wallTime", "wall_time", frozenset({datetime}), _wall_time),
        _Field("ns", "ns", _NO_TYPES, _namespace),
        _Field("txnNumber", "txn_number", frozenset({int, Int64}), _integer),
        _Field("lsid", "lsid", _MAPPING_TYPES, _mapping),
        _Field("collectionUUID", "collection_uuid", frozenset({UUID, Binary}), _uuid),
        _Field("splitEvent", "split_event", _NO_TYPES, _split_event),
        _Field("documentKey", "document_key", _MAPPING_TYPES, _mapping),
        _Field("updateDescription", "update_description", _NO_TYPES, _update_description),
        _Field("fullDocument", "full_document", _MAPPING_TYPES, _mapping),
        _Field("fullDocumentBeforeChange", "full_document_before_change", _MAPPING_TYPES, _mapping),
        _Field("to", "to", _NO_TYPES, _namespace),
        _Field("operationDescription", "operation_description", _MAPPING_TYPES, _mapping),
        _Field("stateBeforeChange", "state_before_change", _MAPPING_TYPES, _mapping),
        _Field("nsType", "ns_type", frozenset({str}), _string),
    )
}
# Common fields absent from nearly every event (transactions, expanded events, splits).
_RARE: Final = ("txn_number", "lsid", "collection_uuid", "split_event")

# read(source, source.get, operation_type, raw)
_EventReader = Callable[
    [Mapping[str, Any], Callable[..., Any], str, Mapping[str, Any]], ChangeEvent
]


def _event_reader(cls: type[ChangeEvent], *, in_place: bool = False,
                  operation_type: OperationType | None = None) -> Any:
    """``read(source, get, operation_type, raw)``; ``in_place``: ``fill(event, doc)``.

    ``fill`` parses a deferred event's document into its slots; ``operation_type``
    is then the class's own value (None for UnknownEvent: the document's string).
    """
    names = [f.name for f in fields(cls) if f.name in _EVENT_FIELDS]
    prologue = (
        "source = doc if type(doc) is dict else dict(doc.items())",
        "get = source.get",
        "raw = doc",
        "operation_type = get('operationType') if _op is None else _op",
    )
    return _compile_reader(
        cls,
        [_EVENT_FIELDS[name] for name in names if name not in _RARE],
        [_EVENT_FIELDS[name] for name in _RARE],
        consumed=frozenset({"operationType"}),  # parse_event has read it
        fixed={"operation_type": "operation_type", "raw": "raw"},
        params=["doc"] if in_place else None,
        prologue=prologue if in_place else (),
        env={"_op": operation_type},
        in_place=in_place,
    )


_READERS: Final[Mapping[str, tuple[OperationType, _EventReader]]] = {
    op.value: (op, _event_reader(cls)) for op, cls in _EVENT_CLASSES.items()
}
_read_unknown: Final[_EventReader] = _event_reader(UnknownEvent)

# For deferred events: the class of each known operationType, and the compiled
# ``fill(event, doc)`` of every class (reached through ``ChangeEvent.__getattr__``).
_CLASSES: Final[Mapping[str, type[ChangeEvent]]] = {
    op.value: cls for op, cls in _EVENT_CLASSES.items()
}
_FILLERS: Final[Mapping[type[ChangeEvent], Callable[[ChangeEvent, Mapping[str, Any]], Any]]] = {
    **{cls: _event_reader(cls, in_place=True, operation_type=op)
       for op, cls in _EVENT_CLASSES.items()},
    UnknownEvent: _event_reader(UnknownEvent, in_place=True),
}
_read_pending: Final[Callable[[_Deferrable], tuple[Mapping[str, Any], EventParser] | None]] = (
    _Deferrable._pending.__get__  # type: ignore[attr-defined]
)
_set_pending: Final[Callable[[_Deferrable, tuple[Mapping[str, Any], EventParser]], None]] = (
    _Deferrable._pending.__set__  # type: ignore[attr-defined]
)


def parse_event(doc: Mapping[str, Any]) -> ChangeEvent | Mapping[str, Any]:
    """Parse a change-stream document into its typed event; never raises on server output.

    A document without a string ``operationType`` (a ``$project``-ed shape) is
    returned as the same object. Sub-documents keep the document's own Mapping
    type (RawBSONDocument stays RawBSONDocument).
    """
    if type(doc) is dict:
        source = doc
    elif isinstance(doc, Mapping):
        # SON, RawBSONDocument and most user mappings implement get() in Python; one
        # C-level snapshot is cheaper than the dozen lookups below (2-3x for raw BSON).
        source = dict(doc.items())
    else:
        return doc
    get = source.get
    op = get("operationType")
    if type(op) is not str and not isinstance(op, str):
        return doc
    known = _READERS.get(op)
    if known is None:
        return _read_unknown(source, get, op, doc)
    return known[1](source, get, known[0], doc)


class EventParser:
    """One stream's ``parse_event``: defers parsing while its consumer skips events.

    An event is only worth parsing if the consumer reads it. Delivered
    deferred, an event is an instance of the right class at once (so
    ``isinstance``, ``match`` on the class and ``type()`` cost nothing) and its
    first field read parses the whole document, exactly as :func:`parse_event`
    would. That first read costs about 1 µs more than parsing on delivery (an
    ``AttributeError`` and ``__getattr__``), so the parser samples: after a
    window of deferred events of which most were read, it parses the next
    ``EAGER_RUN`` events on delivery, then samples again. What the consumer
    sees is the same either way; only the cost moves. Documents must not be
    mutated after delivery (a stream's documents are reachable only through
    the event, and reading ``raw`` parses the event first).
    """

    WINDOW: ClassVar[int] = 64
    EAGER_RUN: ClassVar[int] = 4096

    __slots__ = ("_deferring", "_left", "filled")

    def __init__(self) -> None:
        self._deferring = True
        self._left = self.WINDOW
        self.filled = 0  # deferred events of the current window read so far

    def __call__(self, doc: Mapping[str, Any]) -> ChangeEvent | Mapping[str, Any]:
        """Same as :meth:`parse`."""
        return self.parse(doc)

    def parse(self, doc: Mapping[str, Any]) -> ChangeEvent | Mapping[str, Any]:
        """The typed event of ``doc`` (deferred or parsed); ``doc`` itself if not an event."""
        if self._left:
            self._left -= 1
        else:
            self._next_phase()
        if not self._deferring:
            return parse_event(doc)
        if type(doc) is dict or isinstance(doc, Mapping):
            op = doc.get("operationType")
            if type(op) is str or isinstance(op, str):
                event = _new_event(_CLASSES.get(op, UnknownEvent))
                _set_pending(event, (doc, self))
                return event
        return doc

    def _next_phase(self) -> None:
        """End of a window or of an eager run: decide how the next events are delivered."""
        if self._deferring and self.filled * 2 > self.WINDOW:
            self._deferring, self._left = False, self.EAGER_RUN - 1
        else:
            self._deferring, self._left = True, self.WINDOW - 1
        self.filled = 0


_new_event: Final = object.__new__
