"""How change documents become typed events fast: compiled readers and deferred parsing.

:mod:`changestream.events` declares the event classes, plain frozen dataclasses
that users construct, compare, pickle and match on. Building one per change
through the dataclass ``__init__`` costs about 2 µs (``object.__setattr__`` per
field of a frozen dataclass), a large share of a client's per-event budget. So
this module builds events another way, with identical results:

* **Compiled readers** (:func:`_compile`, :func:`_compile_reader`). For every
  event class a function is generated once, at import, with ``exec``: straight
  -line code that reads each server key, checks its type against a fast set of
  exact types (coercing or rejecting otherwise, rejected values go to ``extra``)
  and stores it. It stores through a private subclass ("twin") that adds no
  slots and keeps plain attribute assignment, then sets ``__class__`` back to
  the public class: same memory layout, about 5x faster than ``__init__``. Each
  reader is checked to set every dataclass field.
* **Shape readers** (:func:`_compile_shape`). A stream's events of one
  operationType nearly always have the same keys, so once the parser parses on
  delivery it compiles, per shape, a reader that takes every value with one
  ``itemgetter`` call (0.6 µs per realistic insert instead of 0.9); any other
  shape or unexpected value goes to the compiled reader above, whose result it
  equals.
* **Deferred parsing** (:class:`EventParser`). A consumer that skips most
  events should not pay for parsing them: an event can be delivered as an
  instance of the right class with no field set and its document kept in the
  ``_pending`` slot; the first attribute read (``ChangeEvent.__getattr__``,
  reached only for an unset slot) calls :func:`fill_deferred`, which parses the
  whole document into the slots at once. The parser samples whether its
  consumer reads events and parses on delivery while it does.
* Namespaces are cached (a stream sees few), and sub-documents keep the
  document's own mapping type.

Nothing here does I/O; every rule about which field holds what is the
declarations' (field names, types, defaults). Import :mod:`changestream.events`,
never this module first: it needs the declared classes, and ``events`` imports
it last to re-export :func:`parse_event` and :class:`EventParser`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from datetime import datetime
from operator import itemgetter
from typing import Any, ClassVar, Final, NamedTuple, TypeVar
from uuid import UUID

from bson.binary import Binary
from bson.datetime_ms import DatetimeMS
from bson.int64 import Int64
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from bson.timestamp import Timestamp

from .events import (
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

__all__ = ["EventParser", "fill_deferred", "parse_event"]


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

# --------------------------------------------------------------------------- shape readers
#
# A stream's events come in very few shapes: for one operationType, the same set
# of keys (the server writes them in a fixed order). For a shape seen once,
# :func:`_compile_shape` generates a reader that fetches every value with one
# C-level ``itemgetter`` call instead of a dozen ``get`` calls, and checks each
# value's exact type against its field's fast set. A document of another shape
# is a miss (the parser learns that shape); any surprise inside (a value of
# another type, a namespace not cached yet) hands the whole document to the
# general reader, so the result is always exactly :func:`parse_event`'s.

_NONE_TYPE: Final = type(None)
_BY_KEY: Final[Mapping[str, _Field]] = {f.key: f for f in _EVENT_FIELDS.values()}
_MISS: Final = object()
"""A shape reader's answer for a document of another shape."""
_ShapeReader = Callable[[dict[str, Any]], Any]


def _no_shape(doc: dict[str, Any]) -> Any:
    """A parser's reader before it has any: always a miss."""
    return _MISS


def _compile_shape(op: str, keys: Sequence[str]) -> _ShapeReader | None:
    """A reader for dicts whose operationType is ``op`` and whose keys are exactly ``keys``.

    The reader checks the keys (their number, and each one's presence) and the
    operationType, and returns :data:`_MISS` for another shape. ``None`` when the shape is not worth a reader (an unknown
    operationType, a non-string key, almost no keys).
    """
    known = _READERS.get(op)
    others = [key for key in keys if key != "operationType"]
    if (known is None or len(others) != len(keys) - 1 or len(others) < 1
            or not all(type(key) is str for key in keys)):
        return None
    operation_type, general = known
    cls = _CLASSES[op]
    attrs = {f.name for f in fields(cls)}
    env: dict[str, Any] = {
        "_general": general, "_op": operation_type, "_ns_get": _NS_CACHE.get, "_dict": dict,
        "_str": str, "_BAD": _BAD, "_MISS": _MISS, "_EMPTY": _EMPTY,
        "_extra_of": _ReadOnlyMapping, "_values": itemgetter("operationType", *others),
        "_op_name": op,
    }
    names = [f"v{i}" for i in range(len(others))]
    # The checks run before the instance exists: a miss or a surprise allocates nothing.
    checks = [
        f"if len(doc) != {len(keys)}:",
        "    return _MISS",
        "try:",
        f"    op, {', '.join(names)} = _values(doc)",
        "except KeyError:",
        "    return _MISS",
        "if op is not _op_name and op != _op_name:",
        "    return _MISS",
    ]
    stores: dict[str, str] = {}
    extra: list[tuple[str, str]] = []
    for i, (key, value) in enumerate(zip(others, names, strict=True)):
        f = _BY_KEY.get(key)
        if f is None or f.attr not in attrs:
            extra.append((key, value))
            continue
        if f.coerce is _namespace:
            checks += [
                f"if type({value}) is _dict and len({value}) == 2"
                f" and type(_db := {value}.get('db')) is _str"
                f" and type(_coll := {value}.get('coll')) is _str"
                f" and (_hit := _ns_get((_db, _coll))) is not None:",
                f"    {value} = _hit",
                f"elif {value} is not None:",
                "    return _general(doc, doc.get, _op, doc)",
            ]
        elif not f.fast:
            env[f"_coerce{i}"] = f.coerce
            checks += [
                f"if {value} is not None:",
                f"    {value} = _coerce{i}({value})",
                f"    if {value} is _BAD:",
                "        return _general(doc, doc.get, _op, doc)",
            ]
        else:
            # The usual type first (one identity test), then the others and None
            # (every event field's default is None).
            env[f"_ok{i}"] = f.fast | {_NONE_TYPE}
            env[f"_usual{i}"] = dict if dict in f.fast else next(iter(f.fast))
            checks += [f"if type({value}) is not _usual{i} and type({value}) not in _ok{i}:",
                       "    return _general(doc, doc.get, _op, doc)"]
        stores[f.attr] = value
    if extra:
        checks.append("extra = _extra_of({" + ", ".join(f"{k!r}: {v}" for k, v in extra) + "})")
    else:
        checks.append("extra = _EMPTY")
    sets: list[str] = []
    for attr in sorted(attrs):
        if attr in stores:
            sets.append(f"self.{attr} = {stores[attr]}")
        elif attr == "operation_type":
            sets.append("self.operation_type = _op")
        elif attr == "extra":
            sets.append("self.extra = extra")
        elif attr == "raw":
            sets.append("self.raw = doc")
        else:
            env[f"_default_{attr}"] = _EVENT_FIELDS[attr].default
            sets.append(f"self.{attr} = _default_{attr}")
    reader: _ShapeReader = _compile(cls, ["doc"], sets, sorted(attrs), env, prologue=checks)
    return reader


def fill_deferred(event: ChangeEvent, name: str) -> Any:
    """``ChangeEvent.__getattr__``: parse a deferred event into its slots, then read ``name``."""
    try:
        pending = _read_pending(event)
    except AttributeError:  # never deferred: an event built by its constructor
        pending = None
    if pending is None or name[:2] == "__":
        raise AttributeError(f"{type(event).__name__!r} object has no attribute {name!r}")
    _FILLERS[type(event)](event, pending[0])
    pending[1].filled += 1
    return object.__getattribute__(event, name)


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
    MAX_SHAPES: ClassVar[int] = 64
    """Shapes (operationType and key order) given a reader of their own; later ones are
    parsed by the general reader. A stream sees a handful."""

    __slots__ = ("_deferring", "_last", "_left", "_readers", "_shapes", "filled")

    def __init__(self) -> None:
        self._deferring = True
        self._left = self.WINDOW
        self._shapes: dict[tuple[str, ...], _ShapeReader | None] = {}
        self._readers: dict[str, _ShapeReader] = {}  # operationType -> its latest shape's
        self._last: _ShapeReader = _no_shape  # the reader of the last event parsed
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
            if type(doc) is dict:
                event = self._last(doc)  # the previous event's shape: the usual case
                if event is not _MISS:
                    return event  # type: ignore[no-any-return]
                op = doc.get("operationType")
                if type(op) is str:
                    reader = self._readers.get(op)
                    if reader is not None:
                        event = reader(doc)
                        if event is not _MISS:
                            self._last = reader
                            return event  # type: ignore[no-any-return]
                    return self._learn(op, doc)
            return parse_event(doc)
        if type(doc) is dict or isinstance(doc, Mapping):
            op = doc.get("operationType")
            if type(op) is str or isinstance(op, str):
                event = _new_event(_CLASSES.get(op, UnknownEvent))
                _set_pending(event, (doc, self))
                return event
        return doc

    def _learn(self, op: str, doc: dict[str, Any]) -> ChangeEvent | Mapping[str, Any]:
        """``doc`` missed its operationType's current reader: switch to its shape's, and parse it."""
        key = (op, *doc)
        if key in self._shapes:
            reader = self._shapes[key]
        elif len(self._shapes) < self.MAX_SHAPES:
            reader = self._shapes[key] = _compile_shape(op, key[1:])
        else:
            reader = None
        if reader is None:
            return parse_event(doc)
        self._readers[op] = self._last = reader
        return reader(doc)  # type: ignore[no-any-return]

    def _next_phase(self) -> None:
        """End of a window or of an eager run: decide how the next events are delivered."""
        if self._deferring and self.filled * 2 > self.WINDOW:
            self._deferring, self._left = False, self.EAGER_RUN - 1
        else:
            self._deferring, self._left = True, self.WINDOW - 1
        self.filled = 0


_new_event: Final = object.__new__
