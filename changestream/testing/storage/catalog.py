"""The simulator's storage engine: databases, collections, documents.

Documents live in insertion ("natural") order, keyed by a hashable canonical
form of their ``_id`` so that ``1``, ``1.0`` and ``Int64(1)`` collide exactly
as they do in BSON. Stored documents are never mutated in place: a write
replaces the stored object, so anything that kept a reference (a cursor, an
oplog entry) keeps seeing the document as it was.
"""

from __future__ import annotations

import uuid
from collections.abc import Hashable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..core.errors import CommandError
from .indexes import DuplicateKey, _UniqueIndex
from .order import copy_value, id_key
from .query import path_values

if TYPE_CHECKING:
    from .deployment import Deployment
    from .history import History


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
        self.shard_key: tuple[str, ...] = ()
        """The shard key's fields when the collection is sharded (set by the cluster):
        they lead ``documentKey`` in the oplog, as on a shard."""

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

    def document_key(self, doc: dict[str, Any]) -> dict[str, Any]:
        """The oplog's ``documentKey`` of ``doc``: the shard key's fields, then ``_id``."""
        if not self.shard_key:
            return {"_id": doc["_id"]}
        key: dict[str, Any] = {}
        for name in self.shard_key:
            values = path_values(doc, name)
            if values and name != "_id":
                key[name] = values[0]
        key["_id"] = doc["_id"]
        return key

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

    def stored_items(self) -> Iterator[tuple[Hashable, dict[str, Any]]]:
        """``(id key, stored document)`` pairs without a snapshot: do not write while iterating."""
        return iter(self._docs.items())

    def stored_by_key(self) -> Mapping[Hashable, dict[str, Any]]:
        """The stored documents by id key, read-only, without a snapshot: do not write while
        reading it."""
        return MappingProxyType(self._docs)

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
        self._catalog.history.record(self.uuid, key, None)
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
        self._catalog.history.record(self.uuid, key, old)
        self._docs[key] = doc
        return old

    def remove(self, key: Hashable) -> dict[str, Any]:
        """Delete the document under ``key`` and return it."""
        old = self._docs.pop(key)
        if self._unique:
            self._unindex_doc(old, key)
        self._catalog.history.record(self.uuid, key, old)
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

_INVALID_DB_CHARS = frozenset('/\\. "$\x00')


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

    @property
    def history(self) -> History:
        """Old document versions, for point-in-time reads."""
        return self._deployment.history

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
