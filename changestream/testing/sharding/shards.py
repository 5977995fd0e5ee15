"""How mongos talks to a shard: in-process calls into the shard primary's command layer.

A request takes the same path as one that came over TCP (failpoints, roles,
labels, cursors registered on that member), without the socket. A shard whose
primary is down or not serving answers as mongos sees it: FailedToSatisfyReadPreference
(133) when a command cannot be sent, HostUnreachable (6) for a cursor whose
mongod restarted. Errors keep their code and are reported as mongos does,
"Error on remote shard <host> :: caused by :: ...".
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any

from ..core.context import ConnectionInfo
from ..core.errors import CommandError
from ..server.dispatch import STATE_CHANGE_CODES
from ..server.listener import MemberServer
from ..server.wire import OP_MSG, Request

if TYPE_CHECKING:
    from ..replset import ReplicaSet
    from ..storage.deployment import Member

INTERNAL_USER = ("__system", "local")
"""Who mongos's connections to the shards are authenticated as (cluster-internal auth)."""
_FIRST_ID = 1_000_000_000
"""Connection ids of mongos's in-process shard connections (apart from TCP ones)."""


def remote_error(reply: dict[str, Any], host: str) -> CommandError:
    """A shard's ``ok: 0`` reply as mongos reports it (state-change errors become 6)."""
    code = reply.get("code")
    code = code if isinstance(code, int) else 1
    message = str(reply.get("errmsg", ""))
    extra = {k: v for k, v in reply.items() if k in ("writeErrors", "writeConcernError")}
    if code in STATE_CHANGE_CODES:
        return CommandError(
            6, f"Error on remote shard {host} :: caused by :: {message}", extra=extra
        )
    return CommandError(
        code, f"Error on remote shard {host} :: caused by :: {message}", extra=extra
    )


class Shard:
    """One shard (a replica set) as one mongos sees it: a connection per member."""

    def __init__(self, name: str, replica_set: ReplicaSet) -> None:
        self.name = name
        self.replica_set = replica_set
        self.deployment = replica_set.deployment
        self._lock = threading.Lock()
        self._conns: dict[int, ConnectionInfo] = {}
        self._ids = itertools.count(_FIRST_ID)

    @property
    def host(self) -> str:
        return f"{self.name}/" + ",".join(m.name for m in self.deployment.members)

    def primary(self) -> Member:
        """The member commands go to; 133 when there is none serving."""
        member = self.deployment.primary
        if member is None or not member.up or member.server is None:
            raise CommandError(
                133,
                f'Could not find host matching read preference {{ mode: "primary" }} '
                f"for set {self.name}",
            )
        return member

    def _conn(self, member: Member) -> ConnectionInfo:
        with self._lock:
            conn = self._conns.get(member.index)
            if conn is None or conn.closed:
                conn = ConnectionInfo(id=next(self._ids), peer=("127.0.0.1", 0), app_name=None)
                conn.user = INTERNAL_USER  # mongos authenticates to the shards (keyFile)
                self._conns[member.index] = conn
            return conn

    def run(self, db: str, body: dict[str, Any], member: Member | None = None) -> dict[str, Any]:
        """Run ``body`` on ``db`` (on the primary, or on ``member``); the reply, ok or not.

        Raises CommandError only when the shard cannot be reached at all.
        """
        target = member if member is not None else self.primary()
        server = target.server
        if not isinstance(server, MemberServer) or not target.up:
            raise CommandError(
                6, f"Error on remote shard {target.name} :: caused by :: Connection refused"
            )
        request = Request(request_id=0, op_code=OP_MSG, body={**body, "$db": db}, db=None)
        return server.dispatcher.run(self._conn(target), request)

    def command(self, db: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run ``body`` on the primary; raise the shard's error as mongos reports it."""
        member = self.primary()
        reply = self.run(db, body, member)
        if reply.get("ok") != 1.0:
            raise remote_error(reply, member.name)
        return reply
