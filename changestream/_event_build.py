"""How change documents and raw BSON become typed events: compiled readers, lazy filling.

:mod:`changestream._event_types` declares the event classes, plain frozen
dataclasses that users construct, compare, pickle and match on. Building one
per change through the dataclass ``__init__`` costs about 2 µs
(``object.__setattr__`` per field of a frozen dataclass), a large share of a
client's per-event budget. So this module fills events another way, with
identical results:

* **Compiled readers** (:func:`_compile`, :func:`_compile_reader`). For every
  event class a function is generated once, at import, with ``exec``: straight
  -line code that reads each server key, checks its type against a fast set of
  exact types (coercing or rejecting otherwise, rejected values go to ``extra``)
  and stores it. It stores through a private subclass ("twin") that adds no
  slots and keeps plain attribute assignment, then sets ``__class__`` back to
  the public class: same memory layout, about 5x faster than ``__init__``. Each
  reader is checked to set every dataclass field, and its source is registered
  in :mod:`linecache` so tracebacks show it.
* **Lazy events** (:class:`EventParser`). A typed stream keeps each event's raw
  BSON and delivers an instance of the right class (read from the
  ``operationType`` bytes) with no field set; the first field read
  (``ChangeEvent.__getattr__``, reached only for an unset slot) decodes the
  event with the stream's codec and fills every slot at once. A consumer that
  skips an event pays for none of its decoding.
* Namespaces are cached (a stream sees few), and sub-documents keep the
  document's own mapping type.

Nothing here does I/O; every rule about which field holds what is the
declarations' (field names, types, defaults).
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from datetime import datetime
from typing import Any, Final, NamedTuple, TypeVar
from uuid import UUID

import bson
from bson.binary import Binary
from bson.codec_options import CodecOptions
from bson.datetime_ms import DatetimeMS
from bson.int64 import Int64
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from bson.timestamp import Timestamp

from ._event_types import (
    _EMPTY,
    _EVENT_CLASSES,
    ChangeEvent,
    Namespace,
    OperationType,
    SplitEvent,
    TruncatedArray,
    UnknownEvent,
    UpdateDescription,
    _Deferrable,
    _ReadOnlyMapping,
)
from ._token import RAW_ID_PREFIX

__all__ = ["EventParser", "parse_event", "raw_operation_type"]


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
    source = "\n".join(lines) + "\n"
    # Registered in linecache under a name of its own, so tracebacks show the generated line.
    filename = f"<changestream._event_build: {lines[0][4:lines[0].index('(')]} {cls.__name__}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
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
        "_dict": dict,
        "_str": str,
        "_ns_get": _NS_CACHE.get,
    }

    def read_field(i: int, f: _Field) -> list[str]:
        names[f"_fast{i}"], names[f"_coerce{i}"], names[f"_default{i}"] = f.fast, f.coerce, f.default
        lines = [
            f"value = get({f.key!r})",
            "if value is None:",
            f"    value = _default{i}",
            "    present -= 1",  # counted as present below; a null counts as absent
        ]
        if f.coerce is _namespace:
            # The cache hit of _namespace inline (a plain {db: str, coll: str}): no call.
            lines += [
                "elif (type(value) is _dict and len(value) == 2"
                " and type(_db := value.get('db')) is _str"
                " and type(_coll := value.get('coll')) is _str"
                " and (_hit := _ns_get((_db, _coll))) is not None):",
                "    value = _hit",
            ]
        return [
            *lines,
            f"elif type(value) not in _fast{i}:",
            f"    value = _coerce{i}(value)",
            "    if value is _BAD:",
            f"        bad = [{f.key!r}] if bad is None else [*bad, {f.key!r}]",
            f"        value = _default{i}",
            f"self.{f.attr} = value",
        ]

    # ``present`` counts the keys accounted for: every field is assumed present and
    # a null one uncounted, so the usual non-null value costs no arithmetic.
    body = [f"present = {len(consumed) + len(main)}", "bad = None"]
    for i, f in enumerate(main):
        body += read_field(i, f)
    body += ["if present == len(source) and bad is None:"]
    body += [f"    self.{f.attr} = _default{i}" for i, f in enumerate(rare, start=len(main))]
    body += ["    self.extra = _EMPTY", "else:", f"    present += {len(rare)}"]
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
        _Field("commitTimestamp", "commit_timestamp", frozenset({Timestamp}), _timestamp),
    )
}
# Common fields absent from nearly every event (transactions, expanded events, splits).
_RARE: Final = ("txn_number", "lsid", "collection_uuid", "split_event", "commit_timestamp")

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
    """One stream's typed events: delivered at once, read when first used.

    ``parse(doc)`` returns an instance of the event's class with no field set
    (so ``isinstance``, ``match`` on the class and ``type()`` cost nothing);
    the first field read fills every slot, exactly as :func:`parse_event`
    would. A consumer that skips an event never pays for reading it.

    Given a ``codec``, a ``RawBSONDocument`` is read straight from its bytes:
    its class comes from the ``operationType`` string in the bytes (the
    server writes it right after ``_id``), and the first field read decodes the
    event with ``codec`` (``raw`` is then that decoded document). Without one,
    or for any other mapping, the mapping itself is read. Documents must not be
    mutated after delivery.
    """

    __slots__ = ("_codec", "_fill_raw")

    def __init__(self, codec: CodecOptions[Any] | None = None) -> None:
        self._codec = codec
        if codec is None:
            self._fill_raw = None
        elif issubclass(codec.document_class, RawBSONDocument):
            document_class = codec.document_class

            def fill_raw(event: ChangeEvent, doc: RawBSONDocument) -> None:
                if type(doc) is not document_class:
                    doc = document_class(doc.raw, codec)
                _FILLERS[type(event)](event, doc)

            self._fill_raw = fill_raw
        else:
            def fill_raw(event: ChangeEvent, doc: RawBSONDocument) -> None:
                _FILLERS[type(event)](event, _decode(doc.raw, codec))

            self._fill_raw = fill_raw

    def __call__(self, doc: Mapping[str, Any]) -> ChangeEvent | Mapping[str, Any]:
        """Same as :meth:`parse`."""
        return self.parse(doc)

    def parse(self, doc: Mapping[str, Any]) -> ChangeEvent | Mapping[str, Any]:
        """The typed event of ``doc``, filled on first read; ``doc`` itself if not an event."""
        fill_raw = self._fill_raw
        if fill_raw is not None and (type(doc) is RawBSONDocument
                                     or isinstance(doc, RawBSONDocument)):
            raw = doc.raw
            cls = _class_in_bytes(raw if type(raw) is bytes else bytes(raw))
            if cls is None:  # not laid out as the server writes events: read it now
                document = self._decoded(doc)
                return parse_event(document)
            event = _new_event(cls)
            _set_pending(event, (doc, fill_raw))
            return event
        if type(doc) is dict or isinstance(doc, Mapping):
            op = doc.get("operationType")
            if type(op) is str or isinstance(op, str):
                event = _new_event(_CLASSES.get(op, UnknownEvent))
                _set_pending(event, (doc, _fill_from))
                return event
        return doc

    def _decoded(self, doc: RawBSONDocument) -> Mapping[str, Any]:
        """``doc`` as the stream's codec gives it."""
        codec = self._codec
        assert codec is not None
        if issubclass(codec.document_class, RawBSONDocument):
            return doc if type(doc) is codec.document_class else codec.document_class(doc.raw, codec)
        return _decode(doc.raw, codec)


def _fill_from(event: ChangeEvent, doc: Mapping[str, Any]) -> None:
    """Fill a deferred event from the mapping it was delivered with."""
    _FILLERS[type(event)](event, doc)


_OPERATION_TYPE: Final = b"\x02operationType\x00"
_CLASS_BY_NAME: Final[Mapping[bytes, type[ChangeEvent]]] = {
    op.value.encode(): cls for op, cls in _EVENT_CLASSES.items()
}


def _operation_type_bytes(raw: bytes) -> bytes | None:
    """A raw event's ``operationType`` bytes when that field follows ``_id`` (as servers send
    it) and is well framed; ``None`` for any other layout."""
    # raw_token_end inline (this runs once per event).
    if not raw.startswith(RAW_ID_PREFIX, 4):
        return None
    at = 9 + int.from_bytes(raw[9:13], "little")
    if not (14 <= at < len(raw) and raw[at - 1] == 0 and raw.startswith(_OPERATION_TYPE, at)):
        return None
    size = int.from_bytes(raw[at + 15:at + 19], "little")
    if size < 1 or raw[at + 18 + size:at + 19 + size] != b"\x00":
        return None
    return raw[at + 19:at + 18 + size]


def raw_operation_type(raw: bytes | memoryview) -> str | None:
    """A raw event's ``operationType`` read from its bytes (``None``: another layout, and
    the caller reads the whole event): one slice per event instead of inflating a
    ``RawBSONDocument`` into a dict of every field."""
    if type(raw) is not bytes:  # a memoryview into a large reply: copy the head only
        raw = bytes(raw[:9 + int.from_bytes(raw[9:13], "little") + 64])
    name = _operation_type_bytes(raw)
    if name is None:
        return None
    try:
        return name.decode()
    except UnicodeDecodeError:
        return None


def _class_in_bytes(raw: bytes) -> type[ChangeEvent] | None:
    """The event class named by a raw event's ``operationType``, when it follows ``_id``.

    ``None`` for any other layout or a name this version does not model (the
    caller then reads the whole event, which also handles unknown types).
    """
    name = _operation_type_bytes(raw)
    return None if name is None else _CLASS_BY_NAME.get(name)


_set_pending: Final[Callable[[_Deferrable, tuple[Any, Callable[[Any, Any], Any]]], None]] = (
    _Deferrable._pending.__set__  # type: ignore[attr-defined]
)
_new_event: Final = object.__new__
_decode: Final = bson.decode
