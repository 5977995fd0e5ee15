"""The simulator's storage engine: databases, collections, documents, indexes.

Documents live in insertion ("natural") order, keyed by a hashable canonical
form of their ``_id`` so that ``1``, ``1.0`` and ``Int64(1)`` collide exactly
as they do in BSON. Stored documents are never mutated in place: a write
replaces the stored object, so anything that kept a reference (a cursor, an
oplog entry) keeps seeing the document as it was.

This module also holds the BSON value semantics the rest of the engine shares
(comparison order, identity, canonical keys, mongod-style rendering for error
messages), because indexes and ``_id`` uniqueness are defined by them.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import uuid
from collections.abc import Callable, Hashable, Iterator, Mapping
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import bson
from bson.binary import Binary
from bson.code import Code
from bson.codec_options import CodecOptions
from bson.datetime_ms import DatetimeMS
from bson.dbref import DBRef
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp
from mongomock import filtering as _mm_filtering

from .errors import CommandError

if TYPE_CHECKING:
    from .deployment import Deployment

# -- BSON value semantics ------------------------------------------------------

_CANONICAL_BY_TYPE: dict[type, int] = {
    type(None): 5,
    int: 10,
    Int64: 10,
    float: 10,
    Decimal128: 10,
    str: 15,
    dict: 20,
    list: 25,
    tuple: 25,
    bytes: 30,
    Binary: 30,
    uuid.UUID: 30,
    ObjectId: 35,
    bool: 40,
    datetime: 45,
    DatetimeMS: 45,
    Timestamp: 47,
    Regex: 50,
    re.Pattern: 50,
    DBRef: 20,
    Code: 60,
    MinKey: -1,
    MaxKey: 127,
}
"""mongod's ``canonicalizeBSONType`` order (MinKey < null < numbers < strings < ...)."""

_CONTAINERS = (dict, list)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_ONE_MS = timedelta(milliseconds=1)
_ENCODE_OPTS: CodecOptions[dict[str, Any]] = CodecOptions(uuid_representation=4)


def canonical_type(value: Any) -> int:
    """The BSON comparison rank of ``value``'s type."""
    rank = _CANONICAL_BY_TYPE.get(type(value))
    if rank is not None:
        return rank
    for typ, typ_rank in _CANONICAL_BY_TYPE.items():
        if isinstance(value, typ):
            return typ_rank
    raise CommandError(2, f"unsupported BSON value of type {type(value).__name__}")


def _millis(value: datetime | DatetimeMS) -> int:
    if isinstance(value, DatetimeMS):
        return int(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return (value - _EPOCH) // _ONE_MS


def _number(value: Any) -> int | float | Decimal:
    if isinstance(value, Decimal128):
        return value.to_decimal()
    return value  # type: ignore[no-any-return]


def _is_nan(value: int | float | Decimal) -> bool:
    if isinstance(value, Decimal):
        return value.is_nan()
    return isinstance(value, float) and math.isnan(value)


def _as_doc(value: Any) -> Any:
    return value.as_doc() if isinstance(value, DBRef) else value


def compare_values(a: Any, b: Any) -> int:
    """BSON comparison (``woCompare``): negative, zero or positive."""
    ta, tb = canonical_type(a), canonical_type(b)
    if ta != tb:
        return -1 if ta < tb else 1
    if ta == 10:
        na, nb = _number(a), _number(b)
        nan_a, nan_b = _is_nan(na), _is_nan(nb)
        if nan_a or nan_b:
            return (not nan_a) - (not nan_b)  # NaN sorts before every number
        return (na > nb) - (na < nb)
    if ta in (15, 35, 40):
        return (a > b) - (a < b)  # type: ignore[no-any-return]
    if ta == 20:
        ia, ib = list(_as_doc(a).items()), list(_as_doc(b).items())
        for (ka, va), (kb, vb) in zip(ia, ib, strict=False):
            c = canonical_type(va) - canonical_type(vb)
            if c:
                return -1 if c < 0 else 1
            if ka != kb:
                return -1 if ka < kb else 1
            c = compare_values(va, vb)
            if c:
                return c
        return (len(ia) > len(ib)) - (len(ia) < len(ib))
    if ta == 25:
        for va, vb in zip(a, b, strict=False):
            c = compare_values(va, vb)
            if c:
                return c
        return (len(a) > len(b)) - (len(a) < len(b))
    if ta == 30:
        ka, kb = _binary_parts(a), _binary_parts(b)
        key_a = (len(ka[1]), ka[0], ka[1])
        key_b = (len(kb[1]), kb[0], kb[1])
        return (key_a > key_b) - (key_a < key_b)
    if ta == 45:
        ma, mb = _millis(a), _millis(b)
        return (ma > mb) - (ma < mb)
    if ta == 47:
        return (a > b) - (a < b)  # type: ignore[no-any-return]
    if ta == 50:
        pa, pb = _regex_parts(a), _regex_parts(b)
        return (pa > pb) - (pa < pb)
    if ta == 60:
        sa, sb = str(a), str(b)
        if sa != sb:
            return -1 if sa < sb else 1
        return compare_values(a.scope or {}, b.scope or {})
    return 0  # null, MinKey, MaxKey


sort_key = functools.cmp_to_key(compare_values)
"""``sorted(values, key=sort_key)`` orders values as mongod does."""


def values_equal(a: Any, b: Any) -> bool:
    """BSON equality (``1 == 1.0``; field order of objects matters)."""
    return compare_values(a, b) == 0


def _binary_parts(value: Any) -> tuple[int, bytes]:
    if isinstance(value, Binary):
        return value.subtype, bytes(value)
    if isinstance(value, uuid.UUID):
        return 4, value.bytes
    return 0, bytes(value)


def _regex_parts(value: Any) -> tuple[str, str]:
    return str(value.pattern), _flags_text(value.flags)


def _flags_text(flags: int | str) -> str:
    if isinstance(flags, str):
        return "".join(sorted(flags))
    letters = {re.IGNORECASE: "i", re.MULTILINE: "m", re.DOTALL: "s", re.VERBOSE: "x"}
    return "".join(sorted(ch for bit, ch in letters.items() if flags & bit))


_BOOL = "\x00bool"
_NULL = ("\x00null",)
_NAN = ("\x00nan",)


def id_key(value: Any) -> Hashable:
    """A hashable key equal for exactly the values BSON considers equal.

    Strings, ObjectIds and numbers are their own keys (Python already equates
    ``1``, ``1.0``, ``Int64(1)`` and ``Decimal("1")``); every other type is
    tagged so it can never collide with another type.
    """
    typ = type(value)
    if typ is str or typ is ObjectId or typ is int or typ is Int64:
        return value  # type: ignore[no-any-return]
    if typ is float:
        return value if value == value else _NAN
    if typ is bool:
        return (_BOOL, value)
    if value is None:
        return _NULL
    if typ is Decimal128:
        dec = value.to_decimal()
        return _NAN if dec.is_nan() else dec
    if isinstance(value, (dict, DBRef)):
        return ("\x00obj", tuple((k, id_key(v)) for k, v in _as_doc(value).items()))
    if isinstance(value, (list, tuple)):
        return ("\x00arr", tuple(id_key(v) for v in value))
    if isinstance(value, (bytes, uuid.UUID)):
        return ("\x00bin", *_binary_parts(value))
    if isinstance(value, (datetime, DatetimeMS)):
        return ("\x00date", _millis(value))
    if isinstance(value, Timestamp):
        return ("\x00ts", value.time, value.inc)
    if isinstance(value, (Regex, re.Pattern)):
        return ("\x00re", *_regex_parts(value))
    if isinstance(value, Code):
        return ("\x00code", str(value), id_key(value.scope) if value.scope else None)
    if isinstance(value, MinKey):
        return ("\x00min",)
    if isinstance(value, MaxKey):
        return ("\x00max",)
    return ("\x00other", repr(value))


def copy_value(value: Any) -> Any:
    """A deep copy of documents and arrays (every other BSON value is immutable)."""
    typ = type(value)
    if typ is dict:
        return {k: (copy_value(v) if type(v) in _CONTAINERS else v) for k, v in value.items()}
    if typ is list:
        return [copy_value(v) if type(v) in _CONTAINERS else v for v in value]
    if isinstance(value, dict):
        return {k: copy_value(v) for k, v in value.items()}
    return value


def values_identical(a: Any, b: Any) -> bool:
    """Same BSON type and bytes (mongod's ``binaryEqualValues``): ``1`` is not ``1.0``."""
    ta, tb = type(a), type(b)
    if ta is tb and ta in (str, ObjectId, bool, type(None)):
        return bool(a == b)
    if ta is int and tb is int:
        return bool(a == b)
    if ta is dict and tb is dict:
        if len(a) != len(b):
            return False
        return all(
            ka == kb and values_identical(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=False)
        )
    if ta is list and tb is list:
        return len(a) == len(b) and all(values_identical(x, y) for x, y in zip(a, b, strict=False))
    try:
        return bson.encode({"": a}, codec_options=_ENCODE_OPTS) == bson.encode(
            {"": b}, codec_options=_ENCODE_OPTS
        )
    except (TypeError, ValueError, bson.errors.InvalidDocument):
        return bool(a == b)


def bson_repr(value: Any) -> str:
    """``value`` rendered the way mongod's ``BSONElement::toString`` shows it in messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(float(value)) if isinstance(value, float) else str(int(value))
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, ObjectId):
        return f"ObjectId('{value}')"
    if isinstance(value, (dict, DBRef)):
        doc = _as_doc(value)
        if not doc:
            return "{}"
        return "{ " + ", ".join(f"{k}: {bson_repr(v)}" for k, v in doc.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[ " + ", ".join(bson_repr(v) for v in value) + " ]" if value else "[]"
    if isinstance(value, (datetime, DatetimeMS)):
        return f"new Date({_millis(value)})"
    if isinstance(value, Timestamp):
        return f"Timestamp({value.time}, {value.inc})"
    if isinstance(value, Decimal128):
        return f'NumberDecimal("{value}")'
    if isinstance(value, (bytes, uuid.UUID)):
        subtype, data = _binary_parts(value)
        if subtype == 4 and len(data) == 16:
            return f'UUID("{uuid.UUID(bytes=data)}")'
        return f"BinData({subtype}, {data.hex().upper()})"
    if isinstance(value, (Regex, re.Pattern)):
        pattern, flags = _regex_parts(value)
        return f"/{pattern}/{flags}"
    return str(value)


def type_name(value: Any) -> str:
    """mongod's ``typeName`` of ``value`` (as used in error messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, Int64):
        return "long"
    if isinstance(value, int):
        return "int" if -(2**31) <= value < 2**31 else "long"
    names: list[tuple[type | tuple[type, ...], str]] = [
        (float, "double"),
        (Decimal128, "decimal"),
        (str, "string"),
        ((Mapping, DBRef), "object"),
        ((list, tuple), "array"),
        ((bytes, uuid.UUID), "binData"),
        (ObjectId, "objectId"),
        ((datetime, DatetimeMS), "date"),
        (Timestamp, "timestamp"),
        ((Regex, re.Pattern), "regex"),
        (Code, "javascript"),
        (MinKey, "minKey"),
        (MaxKey, "maxKey"),
    ]
    for typ, name in names:
        if isinstance(value, typ):
            return name
    return type(value).__name__


# -- paths and queries -----------------------------------------------------------


def path_values(doc: Any, path: str) -> list[Any]:
    """Every value reached by dotted ``path``, traversing arrays as mongod does.

    Arrays met on the way are expanded (``a.b`` over ``a: [{b: 1}, {b: 2}]``
    gives ``[1, 2]``); a numeric component may also index the array. A leaf
    array is returned as one value. Missing paths give ``[]``.
    """
    return _path_values(doc, path.split("."), 0)


def _path_values(value: Any, parts: list[str], i: int) -> list[Any]:
    if i == len(parts):
        return [value]
    part = parts[i]
    if isinstance(value, dict):
        if part in value:
            return _path_values(value[part], parts, i + 1)
        return []
    if isinstance(value, list):
        out: list[Any] = []
        if part.isdigit() and int(part) < len(value):
            out.extend(_path_values(value[int(part)], parts, i + 1))
        for item in value:
            if isinstance(item, dict):
                out.extend(_path_values(item, parts, i))
        return out
    return []


def matches(query: dict[str, Any], doc: dict[str, Any]) -> bool:
    """Whether ``doc`` matches the query filter (mongomock's matcher, mongod's errors)."""
    if not query:
        return True
    try:
        return bool(_mm_filtering.filter_applies(query, doc))  # type: ignore[no-untyped-call]
    except CommandError:
        raise
    except NotImplementedError as exc:
        raise CommandError(2, f"unsupported query operator in the simulator: {exc}") from None
    except Exception as exc:  # mongomock reports bad queries with assorted exceptions
        raise CommandError(2, str(exc) or f"bad query: {bson_repr(query)}") from None


_FAST_SCALARS = (str, int, Int64, float, ObjectId)


def _scalar_matcher(field: str, value: Any) -> Callable[[dict[str, Any]], bool]:
    key = id_key(value)

    def match(doc: dict[str, Any]) -> bool:
        found = doc.get(field, _ABSENT)
        if type(found) is list:
            return any(type(e) in _FAST_SCALARS and id_key(e) == key for e in found)
        return type(found) in _FAST_SCALARS and id_key(found) == key

    return match


_ABSENT = object()


def compile_query(query: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
    """A matcher for ``query``: direct comparisons for top-level scalar equalities
    (the common case), mongomock's general matcher otherwise."""
    simple = all(
        not k.startswith("$") and "." not in k and type(v) in _FAST_SCALARS and v == v
        for k, v in query.items()
    )
    if not simple:
        return functools.partial(_match_with, query)
    checks = [_scalar_matcher(k, v) for k, v in query.items()]
    return lambda doc: all(check(doc) for check in checks)


def _match_with(query: dict[str, Any], doc: dict[str, Any]) -> bool:
    return matches(query, doc)


def id_equality(query: dict[str, Any]) -> tuple[bool, Any]:
    """``(True, value)`` when ``query`` is exactly ``{_id: <value>}`` (a hashed lookup)."""
    if len(query) != 1 or "_id" not in query:
        return False, None
    value = query["_id"]
    if isinstance(value, dict):
        if len(value) == 1 and "$eq" in value:
            value = value["$eq"]
        elif any(k.startswith("$") for k in value):
            return False, None
    if isinstance(value, (list, Regex, re.Pattern, dict)):
        return (isinstance(value, dict) and not any(k.startswith("$") for k in value)), value
    return True, value


# -- errors ------------------------------------------------------------------------


class DuplicateKey(Exception):
    """A write would break a unique index (11000), with mongod's ``keyPattern``/``keyValue``."""

    def __init__(self, ns: str, index: dict[str, Any], key_value: dict[str, Any], legacy: bool):
        self.key_pattern = dict(index["key"])
        self.key_value = key_value
        shown = (
            "{ " + ", ".join(f": {bson_repr(v)}" for v in key_value.values()) + " }"
            if legacy
            else bson_repr(key_value)
        )
        self.errmsg = (
            f"E11000 duplicate key error collection: {ns} index: {index['name']} dup key: {shown}"
        )
        super().__init__(self.errmsg)

    def command_error(self) -> CommandError:
        return CommandError(
            11000, self.errmsg, extra={"keyPattern": self.key_pattern, "keyValue": self.key_value}
        )

    def write_error(self, index: int) -> dict[str, Any]:
        """The ``writeErrors`` entry (``index, code, keyPattern, keyValue, errmsg``)."""
        return {
            "index": index,
            "code": 11000,
            "keyPattern": self.key_pattern,
            "keyValue": self.key_value,
            "errmsg": self.errmsg,
        }


# -- indexes -------------------------------------------------------------------------


class _UniqueIndex:
    """Enforces one unique index: index key -> ``_id`` key of the owning document."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.fields = list(spec["key"])
        self.sparse = bool(spec.get("sparse"))
        self.partial = spec.get("partialFilterExpression")
        self.entries: dict[Hashable, Hashable] = {}

    def keys_for(self, doc: dict[str, Any]) -> list[tuple[Hashable, dict[str, Any]]]:
        """The index keys of ``doc`` (several for arrays), each with its ``keyValue``."""
        if self.partial is not None and not matches(self.partial, doc):
            return []
        per_field: list[list[Any]] = []
        present = False
        for field in self.fields:
            values = path_values(doc, field)
            present = present or bool(values)
            expanded: list[Any] = []
            for v in values or [None]:
                if isinstance(v, list):
                    expanded.extend(v if v else [None])
                else:
                    expanded.append(v)
            per_field.append(expanded)
        if self.sparse and not present:
            return []
        keys: list[tuple[Hashable, dict[str, Any]]] = []
        for combo in itertools.product(*per_field):
            keys.append(
                (tuple(id_key(v) for v in combo), dict(zip(self.fields, combo, strict=False)))
            )
        return keys


class CollectionState:
    """One collection (or view): options, UUID, indexes and documents."""

    def __init__(
        self, catalog: Catalog, db: str, name: str, options: dict[str, Any], *, view: bool = False
    ) -> None:
        self._catalog = catalog
        self.db = db
        self.name = name
        self.uuid: uuid.UUID = uuid.uuid4()
        self.options = options
        """Create options as given (``viewOn``, ``pipeline``, ``validator``, ...)."""
        self.indexes: list[dict[str, Any]] = [] if view else [catalog.id_index_spec(db, name)]
        """Index specs in creation order, ``_id_`` first."""
        self._docs: dict[Hashable, dict[str, Any]] = {}
        self._unique: dict[str, _UniqueIndex] = {}

    def __repr__(self) -> str:
        return f"<CollectionState {self.ns} docs={len(self._docs)}>"

    @property
    def ns(self) -> str:
        return f"{self.db}.{self.name}"

    @property
    def is_view(self) -> bool:
        return "viewOn" in self.options

    @property
    def pre_post_images(self) -> bool:
        """``changeStreamPreAndPostImages: {enabled: true}``: writes keep their images."""
        images = self.options.get("changeStreamPreAndPostImages")
        return isinstance(images, dict) and bool(images.get("enabled"))

    # -- reads (copies: callers may do what they like with them) --------------
    def find_by_id(self, id_value: Any) -> dict[str, Any] | None:
        """A deep copy of the document whose ``_id`` equals ``id_value`` (for updateLookup)."""
        doc = self._docs.get(id_key(id_value))
        return None if doc is None else copy_value(doc)

    def documents(self) -> Iterator[dict[str, Any]]:
        """Deep copies of the documents, in natural (insertion) order."""
        for doc in list(self._docs.values()):
            yield copy_value(doc)

    # -- engine access (stored objects: read-only for callers) ---------------------
    def __len__(self) -> int:
        return len(self._docs)

    def stored(self) -> list[dict[str, Any]]:
        """A snapshot of the stored documents (never mutate them)."""
        return list(self._docs.values())

    def iter_stored(self) -> Iterator[dict[str, Any]]:
        """The stored documents without a snapshot: do not write while iterating."""
        return iter(self._docs.values())

    def lookup(self, key: Hashable) -> dict[str, Any] | None:
        """The stored document with ``_id`` key ``key`` (never mutate it)."""
        return self._docs.get(key)

    def index(self, name: str) -> dict[str, Any] | None:
        return next((spec for spec in self.indexes if spec["name"] == name), None)

    # -- writes -------------------------------------------------------------------
    def insert(self, doc: dict[str, Any]) -> Hashable:
        """Store ``doc`` (``_id`` first, owned by the collection from now on)."""
        key = id_key(doc["_id"])
        if key in self._docs:
            raise self._duplicate(self.indexes[0], {"_id": doc["_id"]})
        if self._unique:
            self._index_doc(doc, key)
        self._docs[key] = doc
        return key

    def replace(self, key: Hashable, doc: dict[str, Any]) -> dict[str, Any]:
        """Replace the stored document under ``key`` (position kept); return the old one."""
        old = self._docs[key]
        if self._unique:
            self._unindex_doc(old, key)
            try:
                self._index_doc(doc, key)
            except DuplicateKey:
                self._index_doc(old, key)
                raise
        self._docs[key] = doc
        return old

    def remove(self, key: Hashable) -> dict[str, Any]:
        """Delete the document under ``key`` and return it."""
        old = self._docs.pop(key)
        if self._unique:
            self._unindex_doc(old, key)
        return old

    def add_index(self, spec: dict[str, Any]) -> None:
        """Add ``spec``; a unique index first checks the existing documents (11000)."""
        if spec.get("unique") and spec["name"] != "_id_":
            unique = _UniqueIndex(spec)
            for key, doc in self._docs.items():
                for ikey, value in unique.keys_for(doc):
                    if ikey in unique.entries and unique.entries[ikey] != key:
                        raise self._duplicate(spec, value)
                    unique.entries[ikey] = key
            self._unique[spec["name"]] = unique
        self.indexes.append(spec)

    def remove_index(self, name: str) -> dict[str, Any]:
        spec = self.index(name)
        if spec is None:
            raise KeyError(name)
        self.indexes.remove(spec)
        self._unique.pop(name, None)
        return spec

    def replace_index(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        """Swap an index spec in place (collMod changes options, not keys)."""
        self.indexes[self.indexes.index(old)] = new
        if new["name"] in self._unique:
            self._unique[new["name"]].spec = new

    def _duplicate(self, spec: dict[str, Any], value: dict[str, Any]) -> DuplicateKey:
        legacy = self._catalog.profile_major_minor <= (4, 2)
        return DuplicateKey(self.ns, spec, value, legacy)

    def _index_doc(self, doc: dict[str, Any], key: Hashable) -> None:
        added: list[tuple[_UniqueIndex, Hashable]] = []
        try:
            for unique in self._unique.values():
                for ikey, value in unique.keys_for(doc):
                    owner = unique.entries.get(ikey)
                    if owner is not None and owner != key:
                        raise self._duplicate(unique.spec, value)
                    if owner is None:
                        unique.entries[ikey] = key
                        added.append((unique, ikey))
        except DuplicateKey:
            for unique, ikey in added:
                del unique.entries[ikey]
            raise

    def _unindex_doc(self, doc: dict[str, Any], key: Hashable) -> None:
        for unique in self._unique.values():
            for ikey, _ in unique.keys_for(doc):
                if unique.entries.get(ikey) == key:
                    del unique.entries[ikey]


# -- the catalog ------------------------------------------------------------------------

_INVALID_DB_CHARS = set('/\\. "$\x00')


def check_db_name(db: str) -> None:
    """InvalidNamespace (73) for names mongod rejects."""
    if not db or _INVALID_DB_CHARS & set(db) or len(db) >= 64:
        raise CommandError(73, f"Invalid database name: '{db}'")


def check_collection_name(db: str, coll: str) -> None:
    """InvalidNamespace (73) for collection names mongod rejects."""
    check_db_name(db)
    if not isinstance(coll, str) or not coll or "\x00" in coll or coll.startswith("."):
        raise CommandError(73, f"Invalid namespace specified '{db}.{coll}'")
    if "$" in coll:
        raise CommandError(73, f"Invalid collection name: {coll}")


class Catalog:
    """Databases -> collections. A database exists while it has a collection."""

    def __init__(self, deployment: Deployment) -> None:
        self._deployment = deployment
        self._dbs: dict[str, dict[str, CollectionState]] = {}

    @property
    def profile_major_minor(self) -> tuple[int, int]:
        return self._deployment.profile.major_minor

    # -- the public read API the change-stream engine relies on -----------------
    def get(self, db: str, coll: str) -> CollectionState | None:
        colls = self._dbs.get(db)
        return None if colls is None else colls.get(coll)

    def database_names(self) -> list[str]:
        return sorted(db for db, colls in self._dbs.items() if colls)

    def collection_names(self, db: str) -> list[str]:
        return sorted(self._dbs.get(db, {}))

    def collections(self, db: str) -> list[CollectionState]:
        """The collections and views of ``db`` in creation order."""
        return list(self._dbs.get(db, {}).values())

    # -- mutations (the commands log them) --------------------------------------------
    def id_index_spec(self, db: str, coll: str) -> dict[str, Any]:
        """The implicit ``_id_`` index spec (4.2 specs still carried ``ns``)."""
        spec: dict[str, Any] = {"v": 2, "key": {"_id": 1}, "name": "_id_"}
        if self.profile_major_minor <= (4, 2):
            spec["ns"] = f"{db}.{coll}"
        return spec

    def new_collection(self, db: str, name: str, options: dict[str, Any]) -> CollectionState:
        """Create and register a collection (or a view when ``options`` has ``viewOn``)."""
        state = CollectionState(self, db, name, options, view="viewOn" in options)
        self.attach(state)
        return state

    def attach(self, state: CollectionState) -> None:
        """Register ``state`` under its ``db``/``name`` (creation or undo of a drop)."""
        colls = self._dbs.setdefault(state.db, {})
        if state.name in colls:
            raise CommandError(48, f"Collection {state.ns} already exists.")
        colls[state.name] = state

    def detach(self, db: str, name: str) -> CollectionState:
        """Unregister and return a collection; the database goes when it is empty."""
        colls = self._dbs[db]
        state = colls.pop(name)
        if not colls:
            del self._dbs[db]
        return state

    def rename(self, state: CollectionState, new_db: str, new_name: str) -> None:
        """Move ``state`` to ``new_db.new_name`` keeping its UUID, documents and indexes."""
        self.detach(state.db, state.name)
        state.db, state.name = new_db, new_name
        if self.profile_major_minor <= (4, 2):
            for spec in state.indexes:
                spec["ns"] = state.ns
        self.attach(state)
