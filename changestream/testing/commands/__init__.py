"""Command registry and the context every command handler receives.

Handlers are plain functions ``handler(ctx) -> dict`` registered with
:func:`command`. They return the reply fields without ``ok``,
``$clusterTime`` and ``operationTime`` (the dispatcher adds those) and raise
:class:`~changestream.testing.errors.CommandError` to fail.

Each module in this package registers its own commands on import; the
dispatcher imports them all through :func:`load_all`.
"""

from __future__ import annotations

import importlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bson.timestamp import Timestamp

from ..errors import ClientDisconnected
from ..wire import peer_closed

if TYPE_CHECKING:
    from ..deployment import Deployment, Member


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
    _closed: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    @property
    def closed(self) -> bool:
        """The server dropped this connection, or found that the client had."""
        return self._closed.is_set()

    def close(self) -> None:
        """Mark the connection closed; an operation waiting in :meth:`sleep` ends at once."""
        self._closed.set()

    def check_connected(self) -> None:
        """Raise :class:`ClientDisconnected` if the connection is gone.

        Called by waiting operations, every :data:`CLIENT_CHECK_SECONDS` at most,
        as mongod checks operations marked "kill on client disconnect".
        """
        if self._closed.is_set():
            raise ClientDisconnected
        if self.sock is not None and peer_closed(self.sock):
            self._closed.set()
            raise ClientDisconnected

    def sleep(self, seconds: float, *, kill_on_disconnect: bool = True) -> None:
        """Sleep ``seconds``; raise :class:`ClientDisconnected` if the connection goes first.

        The server closing the connection always interrupts the sleep (as
        shutdown interrupts mongod's operations); the client closing it only
        when ``kill_on_disconnect``.
        """
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._closed.wait(min(left, CLIENT_CHECK_SECONDS)):
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
    extra_reply: dict[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> Any:
        """The command's first value (collection name, 1, cursor id, ...)."""
        return self.body[self.name]


Handler = Callable[[CommandContext], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """How the dispatcher treats a command."""

    name: str
    handler: Handler
    admin_only: bool = False
    """Only runs against the ``admin`` database (else Unauthorized 13)."""
    write: bool = False
    """Needs a writable primary (else NotWritablePrimary 10107)."""
    locks: bool = True
    """Run while holding ``deployment.lock`` (getMore waits without it)."""
    standalone_ok: bool = True
    secondary_ok: bool = True
    """Reads allowed on a secondary when the request has a secondaryOk read preference."""
    any_member: bool = False
    """Runs on a secondary whatever the read preference (mongod's
    ``AllowedOnSecondary::kAlways``: hello, getMore, killCursors, ...)."""
    handshake: bool = False
    """Allowed over OP_QUERY on 5.1+ (hello/isMaster) and before auth."""
    requires: str | None = None
    """A :class:`~changestream.testing.versions.VersionProfile` flag the command needs;
    without it the command does not exist (CommandNotFound, as on older servers)."""


REGISTRY: dict[str, CommandSpec] = {}


def command(*names: str, **flags: Any) -> Callable[[Handler], Handler]:
    """Register ``handler`` under each of ``names`` (aliases share one spec)."""

    def register(handler: Handler) -> Handler:
        for name in names:
            if name in REGISTRY:
                raise RuntimeError(f"command {name!r} registered twice")
            REGISTRY[name] = CommandSpec(name=names[0], handler=handler, **flags)
        return handler

    return register


_MODULES = (
    "admin",
    "crud",
    "bulk_write",
    "ddl",
    "cursors",
    "failpoints",
    "transactions",
    "aggregate",
)


def load_all() -> dict[str, CommandSpec]:
    """Import every command module of this package and return the registry."""
    for mod in _MODULES:
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as exc:  # a module not written yet
            if exc.name != f"{__name__}.{mod}":
                raise
    return REGISTRY
