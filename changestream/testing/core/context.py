"""What one operation runs with: its client connection and its command's parsed context.

mongod's ``Client`` and ``OperationContext``: every layer above the core (storage,
change streams, commands) receives a :class:`CommandContext`; the server layer
creates the :class:`ConnectionInfo` of each connection.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bson.timestamp import Timestamp

from .errors import ClientDisconnected, CommandError

if TYPE_CHECKING:
    from ..storage.deployment import Deployment, Member
    from .auth import ScramConversation


CLIENT_CHECK_SECONDS = 0.25
"""How often an operation that waits checks that its client is still connected
(mongod checks every 0.5-1 s; an operation that does not wait never checks)."""


@dataclass(slots=True)
class ConnectionInfo:
    """What the server knows about one client connection."""

    id: int
    peer: tuple[str, int]
    app_name: str | None = None
    client_metadata: dict[str, Any] | None = None
    compressors: list[str] = field(default_factory=list)
    """The compressors ``hello`` negotiated on this connection (client's order)."""
    sock: socket.socket | None = field(default=None, repr=False)
    """The server's end (None: a context made without a connection, e.g. in unit tests)."""
    user: tuple[str, str] | None = None
    """``(user, db)`` this connection authenticated as (None: not authenticated)."""
    sasl: ScramConversation | None = field(default=None, repr=False)
    """The SCRAM exchange in progress on this connection (``saslStart`` .. ``saslContinue``)."""
    _closed: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _interrupted: tuple[int, str] | None = field(default=None, init=False, repr=False)

    @property
    def closed(self) -> bool:
        """The server dropped this connection, or found that the client had.

        An interrupted connection is not closed: it still gets its replies.
        """
        return self._closed.is_set() and self._interrupted is None

    def close(self) -> None:
        """Mark the connection closed; an operation waiting in :meth:`sleep` ends at once."""
        self._interrupted = None
        self._closed.set()

    def interrupt(self, code: int, errmsg: str) -> None:
        """Kill the connection's operations with this error (mongod's shutdown).

        An operation waiting now ends with it (and is replied to), and so does
        every command the connection sends from now on.
        """
        self._interrupted = (code, errmsg)
        self._closed.set()

    def check_interrupted(self) -> None:
        """Raise the interrupting error, if the connection's operations were killed."""
        if self._interrupted is not None:
            raise CommandError(*self._interrupted)

    def check_connected(self) -> None:
        """Raise if the operation must end: the interrupting error, or :class:`ClientDisconnected`.

        Called by waiting operations, every :data:`CLIENT_CHECK_SECONDS` at most,
        as mongod checks operations marked "kill on client disconnect".
        """
        if self._closed.is_set():
            self.check_interrupted()
            raise ClientDisconnected
        if self.sock is not None and peer_closed(self.sock):
            self._closed.set()
            raise ClientDisconnected

    def sleep(self, seconds: float, *, kill_on_disconnect: bool = True) -> None:
        """Sleep ``seconds``; raise if the connection goes or is interrupted first.

        The server closing or interrupting the connection always ends the sleep
        (as shutdown interrupts mongod's operations); the client closing it only
        when ``kill_on_disconnect``.
        """
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._closed.wait(min(left, CLIENT_CHECK_SECONDS)):
                self.check_interrupted()
                raise ClientDisconnected
            if kill_on_disconnect:
                self.check_connected()


@dataclass(slots=True)
class CommandContext:
    """One command invocation: where it arrived and what it asked."""

    deployment: Deployment
    member: Member
    connection: ConnectionInfo
    db: str
    name: str
    """The command name as registered (first key of ``body``)."""
    body: dict[str, Any]
    """The command document, OP_MSG document sequences merged in as arrays."""
    lsid: dict[str, Any] | None = None
    txn_number: int | None = None
    start_transaction: bool = False
    autocommit: bool | None = None
    read_preference: dict[str, Any] | None = None
    max_time_ms: int | None = None
    deadline: float | None = None
    """``time.monotonic()`` deadline from ``maxTimeMS`` (None: no limit)."""
    operation_time: Timestamp | None = None
    """Set by handlers that write (the write's ``ts``); default: last applied."""
    is_change_stream: bool = False
    """Set by aggregate/getMore on a change stream (for error labels)."""
    change_stream_cursor: bool = False
    """A change-stream cursor of this process runs (its ``$changeStream`` was parsed): only
    its errors count in 9.0's ``metrics.changeStreams.error.*``."""
    extra_reply: dict[str, Any] = field(default_factory=dict)
    close_connection: bool = False
    """The command runs to its end but its reply is never sent: the connection closes
    instead (``onPrimaryTransactionalWrite``'s ``closeConnection``: mongod ends the session
    and the operation carries on)."""

    @property
    def target(self) -> Any:
        """The command's first value (collection name, 1, cursor id, ...)."""
        return self.body[self.name]


_HAS_POLL = hasattr(select, "poll")
"""poll() has no FD_SETSIZE limit (select() fails for descriptors above 1023)."""


def peer_closed(sock: socket.socket) -> bool:
    """Whether the client closed (or reset) ``sock``, without blocking or consuming data.

    mongod's ``Session::isConnected``: poll for readability, then peek; EOF or
    an error means the peer is gone. Bytes waiting to be read mean it is not.
    """
    try:
        if _HAS_POLL:
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            if not poller.poll(0):
                return False
        elif not select.select([sock], [], [], 0)[0]:
            return False
        return not sock.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):  # reset, or already closed (fileno -1)
        return True
