"""One mongos: a listener (and one for the load balancer) in front of a :class:`Router`, with
its own cursors and failpoints; the cluster's shared state is the config server's
(:class:`~.config_server.ClusterState`).
"""

from __future__ import annotations

import itertools
from typing import Any

from bson.objectid import ObjectId

from ..core.context import ConnectionInfo
from ..core.oplog import Oplog
from ..server.dispatch import Dispatcher
from ..server.listener import MemberServer
from ..server.transport import Connection
from ..server.wire import Request
from ..storage.deployment import Deployment
from .commands import registry_for
from .config_server import ClusterState
from .router import Router

LB_CONNECTION_IDS = 1_000_000_001
"""First ``connectionId`` on a mongos's load-balancer listener (each listener counts its own)."""


class RouterDispatcher(Dispatcher):
    """mongod's request path with mongos's command table."""

    def __init__(self, router: Router, deployment: Deployment, cluster: ClusterState) -> None:
        super().__init__(deployment, deployment.members[0])
        self.registry = registry_for(router)
        aliases: dict[str, set[str]] = {}
        for name, spec in self.registry.items():
            aliases.setdefault(spec.name, set()).add(name)
        self._aliases = {name: frozenset(names) for name, names in aliases.items()}
        self._cluster = cluster

    def run(self, conn: ConnectionInfo, request: Request) -> dict[str, Any]:
        reply = super().run(conn, request)
        cursor = reply.get("cursor")
        if isinstance(cursor, dict) and cursor.get("id"):
            self._cluster.track_cursor(
                self.member.name, conn.id, self.deployment.cursors, int(cursor["id"])
            )
        return reply


class MongosServer(MemberServer):
    """A mongos listener; behind a load balancer its connections are load-balanced ones."""

    def __init__(
        self, mongos: Mongos, host: str, port: int, *, load_balanced: bool = False
    ) -> None:
        super().__init__(mongos.deployment, mongos.member, host, port)
        self.dispatcher = RouterDispatcher(mongos.router, mongos.deployment, mongos.cluster)
        self._cluster = mongos.cluster
        self.load_balanced = load_balanced
        if load_balanced:  # its connections are told apart from the other listener's by id
            self.listener.connection_ids = itertools.count(LB_CONNECTION_IDS)

    def connection_made(self, conn: Connection) -> None:
        super().connection_made(conn)
        if self.load_balanced:
            self._cluster.mark_load_balanced(self.member.name, conn.id)

    def connection_lost(self, conn: Connection) -> None:
        try:
            super().connection_lost(conn)
        finally:
            self._cluster.connection_closed(self.member.name, conn.id)


class Mongos:
    """One mongos: its own cursors and failpoints, a listener, and one for the load balancer."""

    def __init__(self, cluster: ClusterState, index: int, host: str) -> None:
        self.cluster = cluster
        self.index = index
        self.host = host
        self.deployment = Deployment(
            cluster.profile,
            members=1,
            set_name=f"mongos{index}",
            clock=cluster.clock,
            users=cluster.users,
        )
        self.deployment.oplog = Oplog()  # a mongos keeps no oplog: operationTime = cluster time
        self.deployment.cs_metrics.router = True
        self.member = self.deployment.members[0]
        self.member.host = host
        self.service_id = ObjectId()
        self.router = Router(cluster, self.service_id, self.deployment.cs_metrics)
        self.server: MongosServer | None = None
        self.lb_server: MongosServer | None = None

    @property
    def name(self) -> str:
        return self.member.name

    def start(self, port: int, *, load_balanced: bool, lb_port: int = 0) -> None:
        self.server = MongosServer(self, self.host, port)
        self.server.start()
        if load_balanced:
            self.lb_server = MongosServer(self, self.host, lb_port, load_balanced=True)
            self.lb_server.start()
            self.member.port = self.server.port  # the LB listener must not rename the mongos

    def stop(self) -> None:
        """Shut this mongos down: connections close, its cursors (and theirs on shards) die."""
        self.member.up = False
        for server in (self.lb_server, self.server):
            if server is not None:
                server.stop()
        self.deployment.cursors.kill_all()
        self.deployment.close()
