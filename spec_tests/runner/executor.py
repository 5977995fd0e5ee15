"""Running one test of a file against one target ("Executing a Test").

Order: requirements, initialData, createEntities, operations, stop event
recording, disable failpoints, expectEvents, outcome; then, whatever
happened, close change streams and clients (then the async bridge's loop in
the ``changestream-async`` mode), drop what the test touched and (after a
failure) kill all sessions.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import pymongo.common
from bson import json_util
from pymongo.errors import PyMongoError

from . import RunnerError, SpecFailure, SpecSkip
from .adapter import needs_bridge
from .async_bridge import AsyncBridge
from .entities import EntityMap
from .errors import describe
from .events import check_expected_events
from .loader import SpecFile
from .operations import TestContext, run_operation
from .requirements import unmet_any
from .targets import SERVER_SELECTION_TIMEOUT_MS, Target

_TEST_KEYS = frozenset(
    {"description", "runOnRequirements", "skipReason", "operations", "expectEvents", "outcome"}
)

FAST_SDAM_S = 0.01
"""While a test runs, PyMongo's minimum heartbeat interval and its socket poll interval
(how soon a cancelled streaming hello notices) are lowered from 0.5 s, as the spec allows
for tests with failpoints, so a "not primary" or network error costs milliseconds."""

_KNOBS = (("pymongo.common", "MIN_HEARTBEAT_INTERVAL"), ("pymongo.network_layer", "_POLL_TIMEOUT"))
"""(module, attribute); older PyMongo releases may lack some, which are then left alone."""


def _knob_modules() -> list[tuple[Any, str]]:
    found = []
    for module_name, attribute in _KNOBS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, attribute):
            found.append((module, attribute))
    return found


@contextlib.contextmanager
def fast_sdam() -> Iterator[None]:
    """Lower PyMongo's SDAM recovery intervals inside the block (knobs it lacks are left out)."""
    saved = [(mod, name, getattr(mod, name)) for mod, name in _knob_modules()]
    for mod, name, _ in saved:
        setattr(mod, name, FAST_SDAM_S)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def run_test(target: Target, spec: SpecFile, test: dict[str, Any], client_impl: str) -> None:
    """Run one test; raise SpecSkip, SpecFailure or RunnerError unless it passes."""
    unknown = set(test) - _TEST_KEYS
    if unknown:
        raise RunnerError(f"unsupported test keys {sorted(unknown)}")
    reason = unmet_any(spec.run_on, target.info) or unmet_any(
        test.get("runOnRequirements"), target.info
    )
    if reason:
        raise SpecSkip(reason)
    if "skipReason" in test:
        raise SpecSkip(f"skipReason: {test['skipReason']}")
    with fast_sdam():
        _Execution(target, spec, test, client_impl).run()


class _Execution:
    def __init__(
        self, target: Target, spec: SpecFile, test: dict[str, Any], client_impl: str
    ) -> None:
        self.spec = spec
        self.test = test
        self.bridge = AsyncBridge() if needs_bridge(client_impl) else None
        entities = EntityMap(
            target, fast_heartbeat=_sets_failpoints(test["operations"]), bridge=self.bridge
        )
        self.ctx = TestContext(target=target, entities=entities, client_impl=client_impl)
        self.failpoints_disabled = False

    @property
    def internal(self) -> pymongo.MongoClient[dict[str, Any]]:
        return self.ctx.target.internal

    def run(self) -> None:
        try:
            self.setup()
            for index, operation in enumerate(self.test["operations"]):
                run_operation(self.ctx, operation, index)
            self.ctx.entities.stop_recording()
            problems = self.disable_failpoints()
            if problems:
                raise SpecFailure("; ".join(problems))
            self.check_events()
            self.check_outcome()
        except BaseException as exc:
            problems = self.cleanup(failed=True)
            if problems and isinstance(exc, (SpecFailure, RunnerError)) and exc.args:
                exc.args = (f"{exc.args[0]}\n(cleanup after the failure: {'; '.join(problems)})",)
            raise
        problems = self.cleanup(failed=False)
        if problems:
            raise SpecFailure("cleanup failed: " + "; ".join(problems))

    # -- setup -------------------------------------------------------------------
    def setup(self) -> None:
        try:
            self.initial_data()
        except PyMongoError as exc:
            raise SpecFailure(f"initialData: {describe(exc)}") from exc
        try:
            self.ctx.entities.create(self.spec.data.get("createEntities", []))
        except PyMongoError as exc:
            raise SpecFailure(f"createEntities: {describe(exc)}") from exc

    def initial_data(self) -> None:
        for data in self.spec.data.get("initialData", []):
            unknown = set(data) - {"collectionName", "databaseName", "createOptions", "documents"}
            if unknown:
                raise RunnerError(f"initialData keys {sorted(unknown)} are not supported")
            db = self.internal[data["databaseName"]]
            name = data["collectionName"]
            self.ctx.namespaces.add((db.name, name))
            for drop in (name, f"enxcol_.{name}.esc", f"enxcol_.{name}.ecoc"):
                db.drop_collection(drop)
            options = data.get("createOptions")
            if options is not None:
                db.create_collection(name, check_exists=False, **options)
            documents = data["documents"]
            if documents:
                db[name].insert_many(documents)
            elif options is None:
                db.create_collection(name, check_exists=False)

    # -- assertions -----------------------------------------------------------------
    def check_events(self) -> None:
        recorders = self.ctx.entities.recorders()
        for spec in self.test.get("expectEvents", []):
            name = spec["client"]
            self.ctx.entities.client(name)  # raises for an unknown or mistyped entity
            if name not in recorders:
                raise RunnerError(f"expectEvents for client {name!r}, which observes no events")
            check_expected_events(spec, recorders[name], self.ctx.entities)

    def check_outcome(self) -> None:
        for data in self.test.get("outcome", []):
            coll = self.internal[data["databaseName"]].get_collection(
                data["collectionName"],
                read_preference=pymongo.ReadPreference.PRIMARY,
                read_concern=pymongo.read_concern.ReadConcern("local"),
            )
            actual = list(coll.find({}, sort=[("_id", 1)]))
            if _canonical(actual) != _canonical(data["documents"]):
                raise SpecFailure(
                    f"outcome of {coll.full_name}: expected {data['documents']}, got {actual}"
                )

    # -- teardown -------------------------------------------------------------------
    def disable_failpoints(self) -> list[str]:
        if self.failpoints_disabled:
            return []
        self.failpoints_disabled = True
        problems = []
        for client, name in reversed(self.ctx.failpoints):
            off = {"configureFailPoint": name, "mode": "off"}
            # Same client (hence same server) as set it; its own timeoutMS must not apply.
            vias = [self.internal] if client.closed else [client.client, self.internal]
            for via in vias:
                try:
                    with pymongo.timeout(SERVER_SELECTION_TIMEOUT_MS / 1000):
                        via.admin.command(off)
                    break
                except PyMongoError as exc:
                    error = exc
            else:
                problems.append(f"could not disable failpoint {name}: {describe(error)}")
        return problems

    def cleanup(self, failed: bool) -> list[str]:
        """Release everything the test made; return what went wrong (never raise)."""
        self.ctx.entities.stop_recording()
        problems = self.disable_failpoints()
        self.ctx.namespaces |= self.ctx.entities.collection_namespaces()
        problems += self.ctx.entities.close()
        if self.bridge is not None:
            problems += self.bridge.close()
        for db_name, coll_name in sorted(self.ctx.namespaces):
            try:
                self.internal[db_name].drop_collection(coll_name)
            except PyMongoError as exc:
                problems.append(f"could not drop {db_name}.{coll_name}: {describe(exc)}")
        if failed:
            problem = self.ctx.target.kill_all_sessions()
            if problem:
                problems.append(problem)
        return problems


def _sets_failpoints(operations: list[dict[str, Any]]) -> bool:
    """Whether the test might run configureFailPoint (then clients may heartbeat faster)."""
    return any(
        op.get("name") in ("failPoint", "targetedFailPoint")
        or "configureFailPoint" in op.get("arguments", {}).get("command", {})
        for op in operations
    )


def _canonical(documents: list[Any]) -> str:
    """Exact comparison with key order ignored (outcome is not matched loosely)."""
    return json_util.dumps(documents, json_options=json_util.CANONICAL_JSON_OPTIONS, sort_keys=True)
