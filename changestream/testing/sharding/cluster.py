"""``ShardedCluster``: shards (independent replica sets), a config server, mongoses
and optionally a load balancer, all on loopback in this process.

>>> with ShardedCluster("8.0", shards=2, mongoses=2) as cluster:
...     client = pymongo.MongoClient(cluster.uri)

Every shard is its own :class:`~changestream.testing.ReplicaSet` (own catalog,
oplog, cursors, failpoints, ``step_down()``); they share one cluster clock, as
a real cluster's gossip keeps them in step. Each mongos is a server of its own
(own cursors, own failpoints) that routes through the shards' command layer
in-process (:mod:`.mongos`). :class:`~.config_server.ClusterState` holds what
mongos would read from the config server and the migrations (chunk moves, primary
moves) the cluster performs; this module only starts, wires and stops the servers.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from ..core.auth import Users
from ..core.clock import ClusterClock
from ..core.versions import DEFAULT_VERSION, get_profile
from ..replset import ReplicaSet
from ..storage.persist import DbPathError
from .balancer import LoadBalancer
from .config_server import ClusterState
from .dbpath import check_sharded_dbpath
from .mongos import Mongos

_PORT_ATTEMPTS = 20


class ShardedCluster:
    """A simulated sharded cluster: ``shards`` replica sets behind ``mongoses`` mongoses.

    ``port=0`` picks free ports (the mongoses still sit on consecutive ports);
    ``noop_interval`` is every shard's ``periodicNoopIntervalSecs`` (mongod's
    default 10 s): an idle shard holds back other shards' events up to that long
    on a change stream. ``load_balancer=True`` adds a TCP front end
    (:attr:`lb_uri`) that hands each connection to a mongos in turn.
    ``users`` (``{"app": "secret"}``, users of ``admin``) turns authentication on
    on every mongos, behind the load balancer, and on the shards and config
    server (mongos itself authenticates to them, as with a keyFile).
    ``dbpath`` keeps the whole cluster in that directory (``config/`` for the
    config server, one directory per shard): :meth:`stop` writes it, the next
    ``ShardedCluster`` with the same ``dbpath`` (same version or newer) starts
    from it with the same shards, routing table, data, oplogs and cluster time.
    """

    def __init__(
        self,
        version: str = DEFAULT_VERSION,
        shards: int = 2,
        mongoses: int = 2,
        members_per_shard: int = 1,
        load_balancer: bool = False,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        noop_interval: float = 10.0,
        oplog_max_entries: int | None = None,
        users: Mapping[str, str] | None = None,
        dbpath: str | os.PathLike[str] | None = None,
    ) -> None:
        if shards < 1:
            raise ValueError(f"a sharded cluster needs at least one shard, got {shards}")
        if mongoses < 1:
            raise ValueError(f"a sharded cluster needs at least one mongos, got {mongoses}")
        if members_per_shard < 1:
            raise ValueError(f"members_per_shard must be at least 1, got {members_per_shard}")
        self.version = version
        self.profile = get_profile(version)
        self._shard_count = shards
        self._mongos_count = mongoses
        self._members = members_per_shard
        self._load_balancer = load_balancer
        self._port = port
        self._host = host
        self._noop_interval = noop_interval
        self._oplog_max_entries = oplog_max_entries
        self.clock = ClusterClock()
        self.users = Users(users)
        self.dbpath = None if dbpath is None else Path(dbpath)
        self.config = ReplicaSet(
            version, 1, set_name="configRepl", host=host, clock=self.clock, noop_interval=0,
            users=self.users, dbpath=self._dir("config"),
        )  # fmt: skip
        self.state = ClusterState(self.profile, self.clock, self.config, self.users)
        self._mongos: list[Mongos] = []
        self.balancer: LoadBalancer | None = None
        self._started = False
        self._stopped = False
        self._keep_files = False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> ShardedCluster:
        if self._started:
            raise RuntimeError("this ShardedCluster was already started")
        self._started = True
        try:
            if self.dbpath is not None:
                check_sharded_dbpath(self.dbpath, self.state)
            self.config.start()
            restored = self.state.restored_shards()
            for info in restored:
                rs = self._shard_replica_set(info.name).start()
                self.state.add_shard(info.name, rs, restored=info)
            self.state.restore_routing()
            for _ in range(self._shard_count - len(restored)):
                self.add_shard()
            self._start_mongoses()
            if self._load_balancer:
                targets = [m.lb_server.port for m in self._mongos if m.lb_server is not None]
                self.balancer = LoadBalancer(self._host, targets)
                self.balancer.start()
        except BaseException:
            self._keep_files = True  # a failed start leaves the dbpath as it found it
            self.stop()
            raise
        return self

    def _start_mongoses(self) -> None:
        for attempt in range(_PORT_ATTEMPTS):
            mongoses = [Mongos(self.state, i, self._host) for i in range(self._mongos_count)]
            # Linux hands out even ports to bind(0) and odd ones to connect(): port 0's
            # neighbour is often taken, so after one try the mongoses start below the
            # ephemeral range.
            first = self._port or (0 if attempt == 0 else random.randrange(20000, 32000))
            try:
                for i, mongos in enumerate(mongoses):
                    mongos.start(first + i if first else 0, load_balanced=self._load_balancer)
                    if i == 0:
                        assert mongos.server is not None
                        first = mongos.server.port
                self._mongos = mongoses
                return
            except OSError:
                for mongos in mongoses:
                    mongos.stop()
                if self._port:
                    raise
        raise OSError("could not find consecutive free ports for the mongoses")

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.balancer is not None:
            self.balancer.stop()
        for mongos in self._mongos:
            mongos.stop()
        failed: list[DbPathError] = []
        sets = [
            *self.state.replica_sets(), *self.state.pending.values(),
            *self.state.retired.values(), self.config,
        ]  # fmt: skip
        generation = (self.config.deployment.generation or 0) + 1
        for rs in sets:
            if self._keep_files:
                rs.deployment.close(save=False)
            else:  # every file of this stop says so (a file from another stop is refused)
                rs.deployment.generation = generation
        for rs in sets:
            try:
                rs.stop()
            except DbPathError as exc:  # every other member still stops
                failed.append(exc)
        if failed:
            raise failed[0]

    def __enter__(self) -> ShardedCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- shards ------------------------------------------------------------------------------
    def new_shard_replica_set(self) -> ReplicaSet:
        """Start a replica set for this cluster that ``addShard`` can then add."""
        name = self._free_shard_name()
        rs = self._shard_replica_set(name).start()
        self.state.pending[name] = rs
        return rs

    def _free_shard_name(self) -> str:
        """The first ``shard{n}`` no shard, waiting replica set or removed shard has (nor a
        directory in ``dbpath``): a removed shard's name and files are never reused."""
        taken = {
            *self.state.table.shard_names(), *self.state.pending, *self.state.retired,
            *(r.name for r in self.state.removed),
        }  # fmt: skip
        n = 0
        while True:
            name = f"shard{n}"
            folder = self._dir(name)
            if name not in taken and (folder is None or not folder.exists()):
                return name
            n += 1

    def _shard_replica_set(self, name: str) -> ReplicaSet:
        return ReplicaSet(
            self.version,
            self._members,
            set_name=name,
            host=self._host,
            clock=self.clock,
            noop_interval=self._noop_interval,
            oplog_max_entries=self._oplog_max_entries,
            users=self.users,
            dbpath=self._dir(name),
        )

    def _dir(self, name: str) -> Path | None:
        """Where the config server or shard ``name`` keeps its data (None: in memory)."""
        return None if self.dbpath is None else self.dbpath / name

    def add_shard(self) -> str:
        """Start one more shard and add it to the cluster; return its name."""
        rs = self.new_shard_replica_set()
        return self.state.add_shard_by_host(f"{rs.deployment.set_name}/" + ",".join(rs.members))

    @property
    def shards(self) -> list[ReplicaSet]:
        """The shards' replica sets, in ``config.shards`` order."""
        return self.state.replica_sets()

    @property
    def shard_names(self) -> list[str]:
        return self.state.table.shard_names()

    # -- mongoses ----------------------------------------------------------------------------
    @property
    def mongoses(self) -> list[str]:
        """``host:port`` of every mongos that is running."""
        return [m.name for m in self._mongos if m.member.up]

    def mongos(self, index: int) -> Mongos:
        return self._mongos[index]

    def kill_mongos(self, index: int) -> None:
        """Stop mongos ``index`` (its connections drop, its cursors die)."""
        self._mongos[index].stop()

    def restart_mongos(self, index: int) -> str:
        """Start killed mongos ``index`` again on its port; return its ``host:port``.

        It comes back as a new process: no cursors, no failpoints, a new
        ``serviceId`` (behind the load balancer, on its old listener port).
        """
        old = self._mongos[index]
        if old.member.up:
            raise RuntimeError(f"mongos {index} ({old.name}) is already running")
        assert old.server is not None
        mongos = Mongos(self.state, index, self._host)
        lb_port = old.lb_server.port if old.lb_server is not None else 0
        mongos.start(old.server.port, load_balanced=self._load_balancer, lb_port=lb_port)
        self._mongos[index] = mongos
        return mongos.name

    @property
    def uri(self) -> str:
        """Every mongos, for any driver (``mongodb://h:p1,h:p2/``)."""
        if not self._mongos:
            raise RuntimeError("the ShardedCluster is not started")
        return "mongodb://" + ",".join(m.name for m in self._mongos) + "/"

    def mongos_uri(self, index: int) -> str:
        """A URI naming one mongos only."""
        return f"mongodb://{self._mongos[index].name}/"

    @property
    def lb_uri(self) -> str:
        """The load balancer's URI (``loadBalanced=true``)."""
        if self.balancer is None:
            raise RuntimeError("this ShardedCluster has no load balancer (load_balancer=True)")
        return f"mongodb://{self._host}:{self.balancer.port}/?loadBalanced=true"
