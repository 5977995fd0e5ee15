"""The per-test entity map: clients, databases, collections, change streams, values.

Names are unique and lookups check the entity's kind, as the spec requires.
With an :class:`.async_bridge.AsyncBridge` (the ``changestream-async``
mode) every client entity also gets an ``AsyncMongoClient`` mirror, built
from the same URI and keywords, that change streams are opened on.
:meth:`EntityMap.close` closes change streams first, then clients, swallowing
errors (cleanup must not hide the test's own result).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pymongo import MongoClient
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import make_read_preference, read_pref_mode_from_name
from pymongo.server_api import ServerApi
from pymongo.write_concern import WriteConcern

from . import RunnerError
from .async_bridge import AsyncBridge
from .events import EventRecorder
from .matcher import bson_type
from .targets import SERVER_SELECTION_TIMEOUT_MS, Target

DISCOVERY_WAIT_SECONDS = 10.0


def await_discovery(client: Any) -> None:
    """Wait (bounded) until ``client`` has discovered a data-bearing server.

    The tests' first operation must not pay for topology discovery (the
    monitor's connection and first hello): CSOT tests leave 20-50 ms of slack
    (``blockTimeMS`` 150 under ``timeoutMS`` 200), which discovery alone can
    exceed on a loaded machine. It is what a long-lived application client has
    done long before. Emits no command events. (Async clients: ``async_bridge``.)
    """
    deadline = time.monotonic() + DISCOVERY_WAIT_SECONDS
    while not client.topology_description.has_writable_server():
        if time.monotonic() > deadline:
            return  # the test's own operations report the problem
        time.sleep(0.002)


FAST_HEARTBEAT_MS = 50
"""heartbeatFrequencyMS for clients of tests that set failpoints (the unified format allows "a
reduced value", except for a client whose uriOptions set it: those win below): a server
marked Unknown by an injected error is re-checked within 50 ms, not 10 s. At 500 ms each
"not primary"/shutdown case waited about 0.4 s for the re-check (about 2 minutes of the
default suite)."""


@dataclass
class ClientEntity:
    """A MongoClient plus its event recorder (None when it observes nothing).

    ``bridge`` holds the client's async mirror, if the test has one.
    """

    client: MongoClient[dict[str, Any]]
    recorder: EventRecorder | None
    bridge: AsyncBridge | None = None
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.recorder is not None:
                self.recorder.enabled = False
            self.client.close()
            if self.bridge is not None:
                self.bridge.close_client(self.client)


_CLIENT_KEYS = frozenset(
    {
        "id",
        "uriOptions",
        "useMultipleMongoses",
        "observeEvents",
        "ignoreCommandMonitoringEvents",
        "observeSensitiveCommands",
        "serverApi",
    }
)
_DB_KEYS = frozenset({"id", "client", "databaseName", "databaseOptions"})
_COLL_KEYS = frozenset({"id", "database", "collectionName", "collectionOptions"})
_OPTION_KEYS = frozenset({"readConcern", "readPreference", "writeConcern"})


class EntityMap:
    """Entities of one test, by name."""

    def __init__(
        self, target: Target, *, fast_heartbeat: bool = False, bridge: AsyncBridge | None = None
    ) -> None:
        self.target = target
        self.fast_heartbeat = fast_heartbeat
        """Clients get heartbeatFrequencyMS=FAST_HEARTBEAT_MS (the test sets failpoints)."""
        self.bridge = bridge
        """Mirrors every client on an AsyncMongoClient (the ``changestream-async`` mode)."""
        self._entities: dict[str, tuple[str, Any]] = {}
        self._streams: list[Any] = []

    def track_stream(self, stream: Any) -> None:
        """Remember a change stream for closing, whether or not it is saved as an entity."""
        self._streams.append(stream)

    # -- storing and fetching ------------------------------------------------
    def add(self, name: str, kind: str, value: Any) -> None:
        if name in self._entities:
            raise RunnerError(f"entity {name!r} already exists")
        self._entities[name] = (kind, value)

    def kind_of(self, name: str) -> str:
        if name not in self._entities:
            raise RunnerError(f"entity {name!r} is not defined")
        return self._entities[name][0]

    def get(self, name: str, kind: str) -> Any:
        actual = self.kind_of(name)
        if actual != kind:
            raise RunnerError(f"entity {name!r} is a {actual}, not a {kind}")
        return self._entities[name][1]

    def entity(self, name: str) -> Any:
        self.kind_of(name)
        return self._entities[name][1]

    def client(self, name: str) -> ClientEntity:
        value: ClientEntity = self.get(name, "client")
        return value

    def save_result(self, name: str, result: Any) -> None:
        """``saveResultAsEntity``: a change stream, collection, or a BSON value."""
        if isinstance(result, Collection):
            self.add(name, "collection", result)
        elif isinstance(result, Database):
            self.add(name, "database", result)
        elif hasattr(result, "try_next") and hasattr(result, "close"):
            self.add(name, "changeStream", result)
        else:
            bson_type(result)  # raises for values that are not BSON
            self.add(name, "bson", result)

    # -- EntityLookup for the matcher -----------------------------------------
    def bson_entity(self, name: str) -> Any:
        return self.get(name, "bson")

    def session_lsid(self, name: str) -> Mapping[str, Any]:
        raise RunnerError(f"$$sessionLsid {name!r}: session entities are not supported")

    def collection_namespaces(self) -> set[tuple[str, str]]:
        """(database, collection) of every collection entity (dropped after the test)."""
        return {
            (value.database.name, value.name)
            for kind, value in self._entities.values()
            if kind == "collection"
        }

    def recorders(self) -> dict[str, EventRecorder]:
        return {
            name: value.recorder
            for name, (kind, value) in self._entities.items()
            if kind == "client" and value.recorder is not None
        }

    # -- creation --------------------------------------------------------------
    def create(self, specs: list[dict[str, Any]]) -> None:
        """``createEntities``: build each entity in order."""
        for spec in specs:
            if len(spec) != 1:
                raise RunnerError(f"an entity must have exactly one key, got {sorted(spec)}")
            kind, options = next(iter(spec.items()))
            if kind == "client":
                self._create_client(options)
            elif kind == "database":
                self._create_database(options)
            elif kind == "collection":
                self._create_collection(options)
            else:
                raise RunnerError(f"entity type {kind!r} is not supported by this runner")

    def _create_client(self, options: dict[str, Any]) -> None:
        _check_keys("client", options, _CLIENT_KEYS)
        name = options["id"]
        if name in self._entities:
            raise RunnerError(f"entity {name!r} already exists")
        kwargs: dict[str, Any] = {"serverSelectionTimeoutMS": SERVER_SELECTION_TIMEOUT_MS}
        if self.fast_heartbeat:
            kwargs["heartbeatFrequencyMS"] = FAST_HEARTBEAT_MS
        for key, value in options.get("uriOptions", {}).items():
            if isinstance(value, Mapping) and "$$placeholder" in value:
                raise RunnerError(f"uriOptions.{key}: $$placeholder values are not supported")
            kwargs[key] = value
        if "serverApi" in options:
            api = options["serverApi"]
            kwargs["server_api"] = ServerApi(
                api["version"],
                strict=api.get("strict"),
                deprecation_errors=api.get("deprecationErrors"),
            )
        recorder = None
        if options.get("observeEvents"):
            recorder = EventRecorder(
                options["observeEvents"],
                options.get("ignoreCommandMonitoringEvents", []),
                bool(options.get("observeSensitiveCommands", False)),
            )
            kwargs["event_listeners"] = [recorder]
        uri = self._client_uri(options.get("useMultipleMongoses"))
        client: MongoClient[dict[str, Any]] = MongoClient(uri, **kwargs)
        await_discovery(client)
        entity = ClientEntity(client, recorder, self.bridge)
        self.add(name, "client", entity)  # first, so it is closed even if mirroring fails
        if self.bridge is not None:
            self.bridge.register(client, uri, kwargs)

    def _client_uri(self, use_multiple: bool | None) -> str:
        topology = self.target.info.topology
        if topology == "load-balanced":
            return self.target.uri  # the simulator's balancer fronts every mongos
        if topology == "sharded" and use_multiple is not None:
            if use_multiple and len(self.target.hosts) < 2:
                raise RunnerError("useMultipleMongoses: true needs a URI with several mongoses")
            if not use_multiple and len(self.target.hosts) > 1:
                if self.target.single_uri is None:
                    raise RunnerError("useMultipleMongoses: false needs a URI with one mongos")
                return self.target.single_uri
        return self.target.uri

    def _create_database(self, options: dict[str, Any]) -> None:
        _check_keys("database", options, _DB_KEYS)
        client = self.client(options["client"]).client
        db = client.get_database(
            options["databaseName"], **_db_options(options.get("databaseOptions"))
        )
        self.add(options["id"], "database", db)

    def _create_collection(self, options: dict[str, Any]) -> None:
        _check_keys("collection", options, _COLL_KEYS)
        db: Database[dict[str, Any]] = self.get(options["database"], "database")
        coll = db.get_collection(
            options["collectionName"], **_db_options(options.get("collectionOptions"))
        )
        self.add(options["id"], "collection", coll)

    # -- teardown --------------------------------------------------------------
    def stop_recording(self) -> None:
        for recorder in self.recorders().values():
            recorder.enabled = False

    def close(self) -> list[str]:
        """Close change streams, then clients; return client errors (never raise)."""
        problems: list[str] = []
        for stream in self._streams:
            with contextlib.suppress(Exception):  # the spec: suppress errors closing cursors
                stream.close()
        self._streams.clear()
        self.stop_recording()
        for name, (kind, value) in list(self._entities.items()):
            if kind == "client":
                try:
                    value.close()
                except PyMongoError as exc:
                    problems.append(f"closing client {name}: {exc!r}")
        self._entities.clear()
        return problems


def _check_keys(kind: str, options: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = set(options) - allowed
    if unknown:
        raise RunnerError(f"{kind} entity options {sorted(unknown)} are not supported")


def _db_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """collectionOrDatabaseOptions -> get_database/get_collection keywords."""
    if not options:
        return {}
    unknown = set(options) - _OPTION_KEYS
    if unknown:
        raise RunnerError(f"database/collection options {sorted(unknown)} are not supported")
    kwargs: dict[str, Any] = {}
    if "readConcern" in options:
        kwargs["read_concern"] = ReadConcern(options["readConcern"].get("level"))
    if "readPreference" in options:
        kwargs["read_preference"] = read_preference(options["readPreference"])
    if "writeConcern" in options:
        kwargs["write_concern"] = write_concern(options["writeConcern"])
    return kwargs


def read_preference(spec: dict[str, Any]) -> Any:
    """The unified format's readPreference document -> a PyMongo read preference."""
    unknown = set(spec) - {"mode", "tagSets", "maxStalenessSeconds"}
    if unknown:
        raise RunnerError(f"readPreference fields {sorted(unknown)} are not supported")
    mode = read_pref_mode_from_name(spec["mode"])
    return make_read_preference(mode, spec.get("tagSets"), spec.get("maxStalenessSeconds", -1))


def write_concern(spec: dict[str, Any]) -> WriteConcern:
    unknown = set(spec) - {"w", "journal", "wtimeoutMS"}
    if unknown:
        raise RunnerError(f"writeConcern fields {sorted(unknown)} are not supported")
    return WriteConcern(w=spec.get("w"), j=spec.get("journal"), wtimeout=spec.get("wtimeoutMS"))
