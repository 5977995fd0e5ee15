"""The public entry point: a simulated replica set (or standalone) served on loopback.

>>> with ReplicaSet("8.0", members=3) as rs:
...     client = pymongo.MongoClient(rs.uri)

Each member listens on its own port; all members share one deployment
(catalog, oplog, clock), so replication is instantaneous. :meth:`step_down`
emulates a failover, :meth:`kill_member` and :meth:`restart_member` a crash and
a restart of one member, :meth:`stop` mongod's shutdown and :meth:`restart` (with a
``dbpath``) a restart of the whole set.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from types import TracebackType

from bson.objectid import ObjectId

from .core.auth import Users
from .core.clock import ClusterClock
from .core.event_cache import CACHE_BYTES
from .core.topology import elect_next, notify_topology_change
from .core.versions import DEFAULT_VERSION, get_profile
from .server.listener import MemberServer
from .storage.deployment import Deployment, Member
from .storage.persist import DbPathError

log = logging.getLogger(__name__)


class ReplicaSet:
    """A simulated mongod replica set of ``members`` members (or one standalone).

    ``port=0`` picks free ports; ``port=N`` puts the members on N, N+1, ....
    While the set is idle a "periodic noop" oplog entry is written every
    ``noop_interval`` seconds, as mongod does, so idle change streams'
    postBatchResumeToken advances. ``compressors`` is mongod's
    ``networkMessageCompressors`` (a list, ``"zlib,noop"`` or ``"disabled"``;
    default: mongod's snappy, zstd, zlib, those this Python can run).
    ``clock`` is shared by the shards of a sharded cluster (default: its own).
    ``event_cache_bytes`` bounds the memory kept to re-serve change events
    already built for an oplog range (default 16 MiB; output is identical).
    ``dbpath`` keeps the data, oplog, cluster time and term in that directory
    across restarts: :meth:`stop` writes them, the next ``ReplicaSet`` with the
    same ``dbpath`` starts from them (a resume token taken before resumes
    after); :meth:`restart` does both in place, on the same ports. One deployment at a time may use a ``dbpath``. ``users``
    (``{"app": "secret"}``, users of ``admin``) turns authentication on, as
    mongod's ``--auth``: commands other than the handshake need a client
    authenticated with SCRAM-SHA-256 or SCRAM-SHA-1.
    """

    def __init__(
        self,
        version: str = DEFAULT_VERSION,
        members: int = 1,
        *,
        standalone: bool = False,
        set_name: str = "rs0",
        port: int = 0,
        host: str = "127.0.0.1",
        oplog_max_entries: int | None = None,
        oplog_max_bytes: int | None = None,
        noop_interval: float = 10.0,
        compressors: Iterable[str] | str | None = None,
        event_cache_bytes: int | None = None,
        dbpath: str | os.PathLike[str] | None = None,
        users: Mapping[str, str] | Users | None = None,
        clock: ClusterClock | None = None,
    ) -> None:
        if members < 1:
            raise ValueError(f"a replica set needs at least one member, got {members}")
        if event_cache_bytes is not None and event_cache_bytes < 0:
            raise ValueError(f"event_cache_bytes must be >= 0, got {event_cache_bytes}")
        self._new_deployment = functools.partial(
            Deployment,
            get_profile(version),
            members=members,
            set_name=set_name,
            standalone=standalone,
            oplog_max_entries=oplog_max_entries,
            oplog_max_bytes=oplog_max_bytes,
            compressors=compressors,
            event_cache_bytes=CACHE_BYTES if event_cache_bytes is None else event_cache_bytes,
            dbpath=dbpath,
            users=users,
            clock=clock,
        )
        """Builds the deployment, from ``dbpath`` when it holds data (at start and restart)."""
        self.deployment = self._new_deployment()
        self._host = host
        for member in self.deployment.members:
            member.host = host
        self._port = port
        self._noop_interval = noop_interval
        self._servers: list[MemberServer | None] = []
        self._stopped = threading.Event()
        self._noop_thread: threading.Thread | None = None
        self._started = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> ReplicaSet:
        """Start listening on every member; return ``self``."""
        if self._started:
            raise RuntimeError("this ReplicaSet was already started")
        self._started = True
        members = self.deployment.members
        self._listen([self._port + m.index if self._port else 0 for m in members])
        return self

    def _listen(self, ports: list[int]) -> None:
        """Start a server for every member on ``ports`` (0: a free port), and the no-op writer."""
        try:
            for member, port in zip(self.deployment.members, ports, strict=True):
                server = MemberServer(self.deployment, member, member.host, port)
                server.start()
                self._servers.append(server)
        except BaseException:
            self.stop()
            raise
        if not self.deployment.standalone and self._noop_interval > 0:
            self._noop_thread = threading.Thread(
                target=self._write_noops, name="sim-periodic-noop", daemon=True
            )
            self._noop_thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Shut every member down as mongod does, then end the background threads.

        On 5.0+ each member first enters quiesce mode (hellos fail with
        ShutdownInProgress, 91; the simulator's quiesce period is empty).
        Then it stops accepting, operations in flight (a change-stream getMore
        waiting for events, an awaitable hello, a blocked command) fail with
        InterruptedAtShutdown (11600) with the labels mongod gives at this
        version, and the sockets close once those replies are sent.
        """
        self._stopped.set()
        running = [s for s in self._servers if s is not None]
        if self.deployment.profile.quiesce_mode:
            for server in running:
                server.member.quiescing = True
            notify_topology_change(self.deployment)
        for server in running:
            server.shutdown(timeout)
        for member in self.deployment.members:
            member.up = False
        notify_topology_change(self.deployment)
        self.kill_cursors()
        if self._noop_thread is not None:
            self._noop_thread.join(5.0)
        self.deployment.close()  # with a dbpath: write the data for the next start

    def restart(self, timeout: float = 5.0) -> None:
        """Shut the whole set down as :meth:`stop` does, then start it again from its ``dbpath``.

        Every member comes back on its port (the :attr:`uri` stays valid, so
        drivers reconnect) as a new process, with what a restarted mongod
        keeps: the data, the oplog (resume tokens taken before resume after),
        the cluster time and the term (the set elects a primary again: term +
        1 and a "new primary" no-op). Sessions, cursors and failpoints are gone.
        When the data cannot be written or read back it raises
        :class:`~changestream.testing.storage.persist.DbPathError` saying that the set
        is stopped (never a set left down silently).
        """
        self._require_started()
        if self.deployment.dbpath is None:
            raise RuntimeError(
                "restart() needs a dbpath (ReplicaSet(..., dbpath=...)): without one the "
                "data would be lost"
            )
        ports = [m.port for m in self.deployment.members]
        try:
            self.stop(timeout)
            self._servers = []
            self.deployment = self._new_deployment()
        except DbPathError as exc:
            self._servers = []
            raise DbPathError(f"restart failed, the replica set is stopped: {exc}") from None
        for member in self.deployment.members:
            member.host = self._host
        self._stopped = threading.Event()
        self._noop_thread = None
        self._listen(ports)

    def __enter__(self) -> ReplicaSet:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- addresses -----------------------------------------------------------------------------
    @property
    def members(self) -> list[str]:
        """``"host:port"`` of every member."""
        self._require_started()
        return [m.name for m in self.deployment.members]

    @property
    def primary(self) -> str | None:
        self._require_started()
        primary = self.deployment.primary
        return primary.name if primary is not None else None

    @property
    def uri(self) -> str:
        """A connection string for any MongoDB driver."""
        hosts = ",".join(self.members)
        if self.deployment.standalone:
            return f"mongodb://{hosts}/"
        return f"mongodb://{hosts}/?replicaSet={self.deployment.set_name}"

    def _require_started(self) -> None:
        if not self._servers:
            raise RuntimeError(
                "the ReplicaSet is not started (call start() or use it as a context manager)"
            )

    # -- failover and cursors ------------------------------------------------------------------
    def step_down(self, *, close_connections: bool = True) -> str:
        """Elect the next member primary (term + 1); return its ``host:port``.

        ``close_connections=True`` emulates a crashed and restarted primary:
        its connections are dropped and its cursors are gone.
        ``close_connections=False`` is replSetStepDown (4.2+): connections
        stay, writes there fail with NotWritablePrimary, its cursors keep
        working as on a secondary.
        """
        self._require_started()
        deployment = self.deployment
        if deployment.standalone:
            raise RuntimeError("a standalone has no replica set to step down")
        with deployment.lock:
            old = deployment.primary
            new = elect_next(deployment, restart_old=close_connections)
            held = deployment.cursors.ids() if close_connections else []
        if new is None:
            raise RuntimeError("no member is up to become primary")
        if close_connections and old is not None:
            # A crash drops the connections first: a client waiting in a getMore
            # sees a network error (resumable), never a CursorKilled reply.
            server = self._servers[old.index]
            if server is not None:
                server.close_all()
            for cid in held:
                deployment.cursors.kill(cid, old.name)
            deployment.oplog.notify()
        return new.name

    def kill_member(self, index: int) -> None:
        """Kill member ``index`` as ``kill -9`` would: no reply, sockets dropped, port closed.

        Its connections and cursors are gone; if it was the primary, the next
        member that is up is elected at once (term + 1), so drivers fail over
        as after a crash. The set keeps listing it in ``hosts``.
        """
        member, server = self._running(index)
        # The crash drops the sockets first: a client waiting in a getMore sees
        # a network error (resumable), never a reply.
        server.crash()
        self._servers[index] = None
        self._mark_down(member)
        self._forget_cursors(member)

    def stop_member(self, index: int, timeout: float = 5.0) -> None:
        """Shut member ``index`` down as mongod does on SIGTERM; :meth:`restart_member` restarts it.

        A primary steps down first (the next member that is up is elected);
        on 5.0+ the member enters quiesce mode (hellos fail with
        ShutdownInProgress, 91); then operations in flight fail with
        InterruptedAtShutdown (11600) and its sockets close.
        """
        member, server = self._running(index)
        if self.deployment.profile.quiesce_mode:
            member.quiescing = True
            notify_topology_change(self.deployment)
        self._mark_down(member)
        server.shutdown(timeout)
        self._servers[index] = None
        self._forget_cursors(member)

    def _running(self, index: int) -> tuple[Member, MemberServer]:
        self._require_started()
        member, server = self._member_and_server(index)
        if server is None:
            raise RuntimeError(f"member {index} ({member.name}) is not running")
        return member, server

    def _mark_down(self, member: Member) -> None:
        """``member`` is down; if it was the primary, the next member that is up is elected."""
        deployment = self.deployment
        with deployment.lock:
            member.up = False
            if deployment.primary is member and not deployment.standalone:
                elect_next(deployment)

    def _forget_cursors(self, member: Member) -> None:
        """The cursors a member that went away held are gone with it."""
        deployment = self.deployment
        deployment.cursors.kill_all(member.name)
        deployment.oplog.notify()
        notify_topology_change(self.deployment)

    def restart_member(self, index: int) -> str:
        """Start killed member ``index`` again on its port; return its ``host:port``.

        It comes back as a new process (new ``topologyVersion.processId``, no
        failpoints) and as a secondary, unless no member was primary: then it
        is elected. Its data is the set's (replication is instantaneous).
        """
        self._require_started()
        member, server = self._member_and_server(index)
        if server is not None:
            raise RuntimeError(f"member {index} ({member.name}) is already running")
        deployment = self.deployment
        server = MemberServer(deployment, member, member.host, member.port)
        with deployment.lock:
            member.process_id = ObjectId()
            member.topology_counter = 0
            member.failpoints.reset()
            member.quiescing = False
            member.shutting_down = False
        server.start()
        self._servers[index] = server
        with deployment.lock:
            member.up = True
            if deployment.primary is None and not deployment.standalone:
                elect_next(deployment)
        notify_topology_change(self.deployment)
        return member.name

    def _member_and_server(self, index: int) -> tuple[Member, MemberServer | None]:
        members = self.deployment.members
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(members):
            raise IndexError(f"member index must be 0..{len(members) - 1}, got {index!r}")
        return members[index], self._servers[index]

    def kill_cursors(self) -> int:
        """Kill every open cursor on every member; return how many."""
        cursors = self.deployment.cursors
        names = [m.name for m in self.deployment.members]
        killed = sum(cursors.kill(cid, name) for cid in cursors.ids() for name in names)
        self.deployment.oplog.notify()
        return killed

    # -- the periodic no-op writer ----------------------------------------------------------------
    def _write_noops(self) -> None:
        """mongod's NoopWriter: a no-op entry whenever nothing was written for an interval."""
        deployment = self.deployment
        seen = deployment.oplog.end_seq
        while not self._stopped.wait(self._noop_interval):
            try:
                with deployment.lock:
                    if deployment.oplog.end_seq == seen:
                        deployment.log("n", "", {"msg": "periodic noop"})
                    seen = deployment.oplog.end_seq
            except Exception:
                log.exception("periodic no-op write failed")
