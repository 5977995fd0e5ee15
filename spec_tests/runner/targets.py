"""The deployments tests run against: simulators, or the one at ``MONGODB_URI``.

One simulator is started per (version, topology) on first use and reused by
every test that runs there, and at most :data:`MAX_LIVE_SIMULATORS` run at once
(the least recently used one stops first); :meth:`TargetPool.close` stops them
all. Each target has an internal client (majority writes) for initialData,
cleanup and failpoint removal.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import pymongo.common
from pymongo import MongoClient
from pymongo.errors import OperationFailure, PyMongoError
from pymongo.uri_parser import parse_uri

from . import RunnerError
from .errors import describe
from .loader import parse_version
from .requirements import ServerInfo

SERVER_SELECTION_TIMEOUT_MS = 10_000
"""Default for every client the runner creates, so a dead server fails fast."""

SIMULATED_TOPOLOGIES = ("replicaset", "single", "sharded", "load-balanced")
SPEC_NOOP_INTERVAL = 0.1
"""Shards' periodic no-op interval in spec runs: an idle shard holds a stream's events back
until its next no-op, and the spec tests wait for events."""

MAX_LIVE_SIMULATORS = 2
"""How many simulators the pool keeps running at once.

An idle simulator is not free: its shards write a no-op every
:data:`SPEC_NOOP_INTERVAL`, its members and the internal client's monitors wake
up. With every (version, topology) of the matrix alive (about 40 deployments,
~420 threads) the test process spent 15% of a core on them while no test ran,
and a thread's 1 ms sleep woke up to 15 ms late: that is inside the 20-50 ms
slack of the CSOT spec tests, which then timed out at the end of the suite. The
suite runs its cases grouped by target (``pytest_collection_modifyitems`` in
``spec_tests/conftest.py``), so each simulator still starts once."""

_IGNORED_KILL_ALL_SESSIONS_CODES = frozenset({11601, 13})
"""Interrupted (SERVER-38335) and Unauthorized (SERVER-54216), per the spec."""

_FIRST_PYMONGO_WITHOUT_WIRE = {8: "4.16"}
"""First PyMongo release that no longer speaks a wire version (8 = MongoDB 4.2)."""


def pymongo_version_gap(server_version: str, max_wire_version: int) -> str | None:
    """Why the installed PyMongo cannot talk to this server version, if it cannot."""
    if max_wire_version >= pymongo.common.MIN_SUPPORTED_WIRE_VERSION:
        return None
    needs = _FIRST_PYMONGO_WITHOUT_WIRE.get(max_wire_version)
    hint = f" (needs PyMongo <{needs})" if needs else ""
    return f"PyMongo {pymongo.version} cannot talk to MongoDB {server_version}{hint}"


@dataclass
class Target:
    """One reachable deployment and what the requirements are checked against."""

    name: str
    """``8.0-replicaset`` for a simulator, ``MONGODB_URI`` for a real deployment."""
    uri: str
    info: ServerInfo
    internal: MongoClient[dict[str, Any]]
    hosts: list[str] = field(default_factory=list)
    single_uri: str | None = None
    """A sharded cluster: the URI of one mongos (``useMultipleMongoses: false``)."""

    def kill_all_sessions(self) -> str | None:
        """Terminate open transactions (spec: start of suite, after failed tests)."""
        try:
            self.internal.admin.command("killAllSessions", [])
        except OperationFailure as exc:
            if exc.code in _IGNORED_KILL_ALL_SESSIONS_CODES:
                return None
            return f"killAllSessions failed: {describe(exc)}"
        except PyMongoError as exc:
            return f"killAllSessions failed: {describe(exc)}"
        return None


def connect(name: str, uri: str) -> Target:
    """Open the internal client and detect version and topology."""
    internal: MongoClient[dict[str, Any]] = MongoClient(
        uri, w="majority", serverSelectionTimeoutMS=SERVER_SELECTION_TIMEOUT_MS
    )
    try:
        hello = internal.admin.command("hello")
        build = internal.admin.command("buildInfo")
    except PyMongoError as exc:
        internal.close()
        raise RunnerError(f"cannot reach {name} ({_redact(uri)}): {exc}") from exc
    parsed = parse_uri(uri)
    info = ServerInfo(
        version=_version_of(build),
        topology=_topology_of(hello),
        auth=bool(parsed.get("username")),
        auth_mechanisms=tuple(hello.get("saslSupportedMechs", ())),
        get_parameter=lambda param: _get_parameter(internal, param),
    )
    hosts = [f"{host}:{port}" for host, port in parsed["nodelist"]]
    target = Target(name=name, uri=uri, info=info, internal=internal, hosts=hosts)
    problem = target.kill_all_sessions()
    if problem:
        warnings.warn(f"{name}: {problem}", RuntimeWarning, stacklevel=2)
    return target


def _redact(uri: str) -> str:
    if "@" not in uri:
        return uri
    scheme, rest = uri.split("://", 1)
    return f"{scheme}://<credentials>@{rest.split('@', 1)[1]}"


def _version_of(build: dict[str, Any]) -> tuple[int, int, int]:
    array = build.get("versionArray")
    if array and len(array) >= 3:
        return int(array[0]), int(array[1]), int(array[2])
    return parse_version(str(build.get("version", "0")))


def _topology_of(hello: dict[str, Any]) -> str:
    if hello.get("serviceId") is not None:
        return "load-balanced"
    if hello.get("msg") == "isdbgrid":
        return "sharded"
    if hello.get("setName") is not None:
        return "replicaset"
    return "single"


def _get_parameter(client: MongoClient[dict[str, Any]], name: str) -> Any:
    try:
        reply = client.admin.command({"getParameter": 1, name: 1})
    except OperationFailure as exc:
        raise KeyError(name) from exc
    if name not in reply:
        raise KeyError(name)
    return reply[name]


class TargetPool:
    """Simulators by (version, topology), started lazily; or one real deployment."""

    def __init__(self, real_uri: str | None = None, max_live: int = MAX_LIVE_SIMULATORS) -> None:
        if max_live < 1:
            raise RunnerError(f"a target pool keeps at least 1 simulator running, not {max_live}")
        self.real_uri = real_uri
        self.max_live = max_live
        self.started = 0
        """Simulators started so far (a stopped one that is needed again starts again)."""
        self._targets: OrderedDict[tuple[str, str], tuple[Target, contextlib.ExitStack]] = (
            OrderedDict()
        )
        """Live simulators, least recently used first."""
        self._real: Target | None = None
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock()

    def real(self) -> Target:
        """The ``MONGODB_URI`` deployment (connected on first use)."""
        assert self.real_uri is not None
        with self._lock:
            if self._real is None:
                self._real = connect("MONGODB_URI", self.real_uri)
                self._stack.callback(self._real.internal.close)
            return self._real

    def get(self, version: str, topology: str) -> Target:
        """The target for one matrix cell (the real deployment if ``MONGODB_URI`` is set)."""
        if self.real_uri is not None:
            return self.real()
        with self._lock:
            key = (version, topology)
            if key in self._targets:
                self._targets.move_to_end(key)
                return self._targets[key][0]
            while len(self._targets) >= self.max_live:
                _, (_, stack) = self._targets.popitem(last=False)
                stack.close()
            stack = contextlib.ExitStack()
            try:
                target = self._start_simulator(version, topology, stack)
            except BaseException:
                stack.close()
                raise
            self._targets[key] = (target, stack)
            self.started += 1
            return target

    def live(self) -> list[tuple[str, str]]:
        """The (version, topology) of each running simulator, least recently used first."""
        with self._lock:
            return list(self._targets)

    def _start_simulator(self, version: str, topology: str, stack: contextlib.ExitStack) -> Target:
        if topology not in SIMULATED_TOPOLOGIES:
            raise RunnerError(f"the simulator cannot emulate topology {topology!r}")
        try:
            from changestream.testing import ReplicaSet, ShardedCluster, get_profile
        except ImportError as exc:
            raise RunnerError(f"the simulator is not available: {exc}") from exc
        single_uri = None
        if topology in ("sharded", "load-balanced"):
            # Behind the load balancer one mongos, as the drivers' SINGLE_MONGOS_LB_URI:
            # failpoints are per mongos, so every connection must reach the same one.
            cluster = ShardedCluster(
                version,
                shards=2,
                mongoses=1 if topology == "load-balanced" else 2,
                load_balancer=topology == "load-balanced",
                noop_interval=SPEC_NOOP_INTERVAL,
            )
            stack.enter_context(cluster)
            uri = cluster.lb_uri if topology == "load-balanced" else cluster.uri
            single_uri = cluster.lb_uri if topology == "load-balanced" else cluster.mongos_uri(0)
        else:
            simulator = ReplicaSet(version=version, members=1, standalone=topology == "single")
            stack.enter_context(simulator)
            uri = simulator.uri
        target = connect(f"{version}-{topology}", uri)
        target.single_uri = single_uri
        stack.callback(target.internal.close)
        expected = parse_version(get_profile(version).version)
        if target.info.version != expected or target.info.topology != topology:
            raise RunnerError(
                f"simulator {version}-{topology} reports {target.info.version_text} "
                f"{target.info.topology}, expected {'.'.join(map(str, expected))} {topology}"
            )
        return target

    def close(self) -> None:
        """Close internal clients and stop every simulator."""
        with self._lock:
            while self._targets:
                _, (_, stack) = self._targets.popitem()
                stack.close()
            self._real = None
            self._stack.close()
