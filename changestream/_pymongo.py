"""Transport: runs the machine's commands through PyMongo, pinned to one server per cursor.

``Database.command`` re-selects a server on every call, so a getMore could
reach a server that does not hold the cursor. Instead this module selects a
server itself (by read preference for an aggregate, by address for
getMore/killCursors), checks out a connection from that server and runs the
command on it. This is the ONLY module touching non-public PyMongo API; every
item below exists with the same call shape in PyMongo 4.14 and 4.20:

The same items exist on ``AsyncMongoClient`` / ``AsyncConnection`` (awaited),
so :class:`AsyncTransport` shares the routing below with :class:`SyncTransport`.

* ``MongoClient._ensure_session()``: the implicit session PyMongo itself lends
  (not causally consistent, marked dirty on network errors). The stream keeps
  it for its whole life and ends it on close (``AsyncClientSession.end_session``
  is a coroutine).
* ``MongoClient._select_server(selector, session, operation, address=None)``:
  server selection (honours CSOT and ``serverSelectionTimeoutMS``; records
  the server's minimum RTT for CSOT).
* ``MongoClient._conn_from_server(read_preference, server, session)``:
  context manager (async context manager on ``AsyncMongoClient``) yielding
  ``(connection, effective_read_preference)``; it
  runs SDAM error handling (a "not primary" or network error marks the server
  unknown and clears its pool, as for PyMongo's own operations) and applies
  the direct-connection read-preference rule.
* ``Connection.command(db, spec, read_preference=, codec_options=,
  read_concern=, session=, client=)``: publishes command-monitoring events,
  attaches ``lsid``/``$clusterTime``/``$readPreference``/``readConcern``,
  processes ``$clusterTime``/``operationTime`` of the reply and, under CSOT,
  writes ``spec["maxTimeMS"] = remaining - minRTT`` and sets socket timeouts.
* ``Connection.max_wire_version``: the failing connection's wire version for
  the resumable-error rules.
* ``MongoClient._close_cursor_soon(cursor_id, _CursorAddress(address,
  namespace))`` and ``ClientSession._end_implicit_session()``: what PyMongo's
  own cursors do when garbage collected. The cursor is queued for PyMongo's
  background killCursors task and the implicit session goes back to the pool,
  both without I/O (see :meth:`SyncTransport.abandon`).
* ``pymongo._csot.get_timeout()``: whether a client-side timeout (or a
  ``pymongo.timeout()`` block) is in force.
* ``PyMongoError._error_labels`` / ``_add_error_label``: all labels of an
  error, including ones added client-side.
* ``helpers_shared._check_command_response(reply, wire_version)``: rebuilds a
  server error from a ``dict`` reply (see :func:`_with_dict_details`).

Load-balanced mode (``loadBalanced=true``): the cursor lives on one connection,
so the connection an aggregate ran on stays checked out (pinned, PyMongo's
checkout context kept open in an ``ExitStack``) while its cursor is open;
getMore and killCursors run on it without server selection; the pin is
released when the cursor is exhausted or killed, or when a command on it fails
(the error goes through PyMongo's handler, which clears the service's pool on a
network error). Whether to send killCursors after such an error is the
machine's rule (:attr:`ReplyInfo.load_balanced`).

Plain cursors (a snapshot copy's ``aggregate``/``find``, then ``getMore``): the same
transport, through :class:`SyncCursorReader` / :class:`AsyncCursorReader`, which remember
the server each open cursor came from and send its getMore and killCursors there (with
two mongoses in the URI, ``Database.command`` would send the getMore to either).

CSOT and getMore: the change-streams CSOT rule is ``maxTimeMS = min(
maxAwaitTimeMS, remaining - minRTT)`` and *no* ``maxTimeMS`` without
``maxAwaitTimeMS``. ``Connection.command`` would overwrite it with
``remaining - minRTT``, so getMore specs are a :class:`_AwaitSpec` whose
``maxTimeMS`` that hook can only lower, never add.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
from collections.abc import Mapping
from typing import Any, cast

import bson
import pymongo
from bson.codec_options import DEFAULT_CODEC_OPTIONS, CodecOptions
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from pymongo import _csot, helpers_shared
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.mongo_client import AsyncMongoClient
from pymongo.errors import (
    AutoReconnect,
    ConnectionFailure,
    NotPrimaryError,
    OperationFailure,
    PyMongoError,
    ServerSelectionTimeoutError,
)
from pymongo.message import _CursorAddress
from pymongo.read_preferences import ReadPreference
from pymongo.synchronous.client_session import ClientSession
from pymongo.synchronous.mongo_client import MongoClient

from ._diagnosis import authentication_failed
from ._machine import Command, ErrorInfo, KillCursors, ReplyInfo, RunAggregate, RunGetMore

__all__ = [
    "AsyncCursorReader",
    "AsyncTransport",
    "CommandResult",
    "SyncCursorReader",
    "SyncTransport",
    "csot_context_active",
    "error_info",
    "plain_command_spec",
]

CommandResult = tuple[Mapping[str, Any], ReplyInfo] | ErrorInfo

log = logging.getLogger("changestream.stream")

ASIDE_TIMEOUT = 5.0
"""Seconds a killCursors sent aside (a close from another thread or task) may take: a close
must not hang on a server that does not answer (the getMore's own close follows anyway)."""

_RAW: CodecOptions[Any] = CodecOptions(document_class=RawBSONDocument)
"""Replies arrive raw: tokens keep their exact bytes, events are decoded once, with the user's codec.

A failed command raises from the raw reply, as in PyMongo's own change streams
(SDAM then reads no ``topologyVersion`` from the error). A shell may ask for
successful replies in ``options.reply_codec(...)``: decoded in one C pass.
"""


class _AwaitSpec(SON[str, Any]):
    """A getMore spec whose ``maxTimeMS`` CSOT may lower but never add (see module docstring)."""

    def __init__(self, command: Mapping[str, Any]) -> None:
        super().__init__(command)
        self._sealed = True

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "maxTimeMS" and getattr(self, "_sealed", False):
            current = self.get("maxTimeMS")
            if current is None:
                return
            value = min(current, value)
        super().__setitem__(key, value)


def plain_command_spec(body: dict[str, Any]) -> dict[str, Any] | SON[str, Any]:
    """``body`` as sent through ``Database.command``: a getMore gets no ``maxTimeMS`` from CSOT.

    Under a client-side timeout ``Connection.command`` writes ``maxTimeMS`` into
    every command, and mongod refuses it on the getMore of a cursor that is not
    awaitData (BadValue, "cannot set maxTimeMS on getMore command for a
    non-awaitData cursor"); PyMongo's own cursors leave it out. The timeout
    still bounds the socket.
    """
    return _AwaitSpec(body) if next(iter(body), None) == "getMore" else body


def csot_context_active() -> bool:
    """Is the caller inside ``pymongo.timeout(...)`` (which then overrides the client's ``timeoutMS``)?"""
    return _csot.get_timeout() is not None


def error_info(exc: Exception, wire_version: int | None) -> ErrorInfo:
    """Translate a PyMongo (or other) exception into the machine's :class:`ErrorInfo`."""
    if not isinstance(exc, PyMongoError):
        return ErrorInfo(exception=exc, wire_version=wire_version)
    details = exc.details if isinstance(exc, (OperationFailure, NotPrimaryError)) else None
    is_server = isinstance(details, Mapping) and "code" in details
    code = details.get("code") if is_server and isinstance(details, Mapping) else None
    if isinstance(exc, OperationFailure) and code is None:
        code = exc.code
    labels = set(getattr(exc, "_error_labels", ()))
    if is_server and isinstance(details, Mapping):
        # NotPrimaryError reads labels only from a dict reply; replies here are raw.
        labels.update(details.get("errorLabels") or ())
    return ErrorInfo(
        exception=exc,
        code=code if isinstance(code, int) else None,
        labels=frozenset(labels),
        wire_version=wire_version,
        is_network=isinstance(exc, ConnectionFailure) and not is_server,
        is_timeout=bool(exc.timeout and _csot.get_timeout()),
        is_server_selection=isinstance(exc, ServerSelectionTimeoutError),
    )


@dataclasses.dataclass(frozen=True)
class _Route:
    """How one command reaches its server; shared by the sync and async transports."""

    operation: str
    selector: Any
    """Read preference for server selection and connection checkout."""
    address: Any
    """``None``: select by ``selector``; else the server holding the cursor."""
    spec: SON[str, Any]
    read_concern: Any
    is_aggregate: bool

    def read_preference(self, effective: Any) -> Any:
        """What the command sends: the checkout's effective preference for an aggregate only."""
        return effective if self.is_aggregate else ReadPreference.PRIMARY


def _route(client: Any, command: Command) -> _Route:
    """Route ``command``; raise ``AutoReconnect`` for a killCursors on an unknown server."""
    if isinstance(command, RunAggregate):
        return _Route("aggregate", command.read_preference, None, SON(command.command),
                      command.read_concern, True)
    if isinstance(command, RunGetMore):
        return _Route("getMore", ReadPreference.PRIMARY, command.address,
                      _AwaitSpec(command.command), None, False)
    description = client.topology_description.server_descriptions().get(command.address)
    if description is None or not description.is_server_type_known:
        # Never wait for an unreachable server just to kill a cursor (best effort).
        raise AutoReconnect(f"server {command.address} is unavailable; cursor not killed")
    return _Route("killCursors", ReadPreference.PRIMARY, command.address, SON(command.command),
                  None, False)


def _with_dict_details(exc: PyMongoError, wire_version: int | None) -> PyMongoError:
    """The same server error, with ``details`` decoded to a ``dict``.

    Replies are requested raw (tokens stay byte-exact), but PyMongo's SDAM
    stale-error check reads ``topologyVersion`` only from ``dict`` details: a
    raw one makes a current "not primary" error look new, marks the server
    Unknown and stalls the next server selection until a heartbeat. Raised
    inside the checkout so SDAM sees this version, exactly as for PyMongo's
    own operations.
    """
    details = exc.details if isinstance(exc, (OperationFailure, NotPrimaryError)) else None
    if not isinstance(details, RawBSONDocument):
        return exc
    try:
        helpers_shared._check_command_response(bson.decode(details.raw), wire_version)
    except PyMongoError as decoded:
        for label in getattr(exc, "_error_labels", ()):
            decoded._add_error_label(label)
        return decoded
    return exc


def _decoded(reply: Mapping[str, Any], codec: CodecOptions[Any]) -> Mapping[str, Any]:
    """A raw reply in the shell's reply codec (decoded once, in C), without the collector.

    Decoding a batch allocates some 15 containers per event; the cyclic garbage
    collector would run a few dozen times during it, each time traversing the
    new objects, which cannot form cycles (BSON is a tree). Pausing it for the
    call leaves one collection afterwards: 5-10% of the client's CPU per event
    on realistic batches (benchmarks/README.md). A collector the application
    disabled stays disabled.
    """
    if codec is _RAW:
        return reply
    if not gc.isenabled():
        return bson.decode(cast(RawBSONDocument, reply).raw, codec)
    gc.disable()
    try:
        return bson.decode(cast(RawBSONDocument, reply).raw, codec)
    finally:
        gc.enable()


def _load_balanced(client: Any) -> bool:
    return bool(client.topology_description.topology_type_name == "LoadBalanced")


def _keeps_cursor(command: Command, reply: Mapping[str, Any]) -> bool:
    """Does the cursor live on after ``reply`` (so a pinned connection stays checked out)?"""
    if isinstance(command, KillCursors):
        return False
    cursor = reply.get("cursor")
    return bool(cursor is not None and cursor.get("id"))


@dataclasses.dataclass
class _Checkout:
    """One command's connection: PyMongo's checkout context, held open in ``stack``.

    In load-balanced mode it outlives the command while the cursor is open (the pin).
    """

    stack: Any
    """An ``ExitStack`` / ``AsyncExitStack`` holding PyMongo's checkout context."""
    address: Any
    load_balanced: bool
    conn: Any = None
    read_preference: Any = None


def _aside_failed(kill: KillCursors, exc: Exception) -> None:
    """A killCursors aside failed: said (debug), then left to the close that follows."""
    log.debug("killCursors of cursor %s sent aside failed (the close kills it after the "
              "getMore returns): %r", kill.command["cursors"][0], exc)


def _abandon(client: Any, session: Any, owns_session: bool, kill: KillCursors | None) -> None:
    """Queue ``kill`` for the client's background killCursors task; end an implicit session.

    No I/O and no awaiting: safe from ``__del__`` of a sync or async stream.
    """
    if kill is not None:
        namespace = f"{kill.database}.{kill.command['killCursors']}"
        client._close_cursor_soon(int(kill.command["cursors"][0]),
                                  _CursorAddress(kill.address, namespace))
    if owns_session and session is not None:
        session._end_implicit_session()


class _Transport:
    """What both transports share: the stream's session, command routing, outcomes, cleanup.

    Only the I/O (server selection, checkout, the command, ending the session)
    is written twice, in :class:`SyncTransport` and :class:`AsyncTransport`,
    because one awaits it; every decision around it lives here.
    """

    def __init__(self, client: Any, session: Any, reply_codec: CodecOptions[Any]) -> None:
        self._client = client
        self._reply_codec = reply_codec
        self._owns_session = session is None
        self._session = session if session is not None else client._ensure_session()
        self._pin: _Checkout | None = None
        """Load-balanced mode: the connection the open cursor lives on."""

    @property
    def load_balanced(self) -> bool:
        """Behind a load balancer a cursor lives on one connection: nothing reaches it aside."""
        return _load_balanced(self._client)

    def _check_credentials(self, command: Command) -> None:
        """Before an aggregate: raise the authentication failure that left no member usable.

        After failed authentication PyMongo marks the member Unknown until its next
        heartbeat (10 s by default), so server selection would wait that long and
        fail the same way; only new credentials help, so say so at once.
        """
        if not isinstance(command, RunAggregate):
            return
        servers = self._client.topology_description.server_descriptions().values()
        if any(server.is_server_type_known for server in servers):
            return
        for server in servers:
            if server.error is not None and authentication_failed(server.error):
                raise copy.copy(server.error)

    def _take_pin(self, route: _Route) -> _Checkout | None:
        """The pinned connection a getMore/killCursors runs on (taken: the run re-pins)."""
        if route.is_aggregate:
            return None
        pin, self._pin = self._pin, None
        return pin

    def _checkout(self, server: Any, stack: Any) -> _Checkout:
        return _Checkout(stack, server.description.address, _load_balanced(self._client))

    def _context(self, route: _Route, server: Any) -> Any:
        return self._client._conn_from_server(route.selector, server, self._session)

    def _keep(self, checkout: _Checkout, command: Command, reply: Mapping[str, Any]) -> None:
        """Pin the connection while a load-balanced cursor lives on it (spec: LB cursors)."""
        if checkout.load_balanced and _keeps_cursor(command, reply):
            self._pin = dataclasses.replace(checkout, stack=checkout.stack.pop_all())

    def _command_kwargs(self, route: _Route, effective_read_preference: Any) -> dict[str, Any]:
        """Keyword arguments of ``Connection.command`` for ``route`` (replies always raw)."""
        return {
            "read_preference": route.read_preference(effective_read_preference),
            "codec_options": _RAW,
            "read_concern": route.read_concern,
            "session": self._session,
            "client": self._client,
        }

    def _aside_kwargs(self, route: _Route, effective_read_preference: Any) -> dict[str, Any]:
        """:meth:`_command_kwargs` without the stream's session: a command sent from another
        thread or task while the session is in use by the stream's own command."""
        return {**self._command_kwargs(route, effective_read_preference), "session": None}

    def _reply(self, reply: Mapping[str, Any], checkout: _Checkout, wire_version: int) -> CommandResult:
        return _decoded(reply, self._reply_codec), ReplyInfo(checkout.address, wire_version,
                                                             checkout.load_balanced)

    def _end_owned_session(self) -> Any:
        """The implicit session to end now (a caller's session is left alone), or ``None``."""
        if self._owns_session and self._session is not None:
            session, self._session = self._session, None
            return session
        return None

    def abandon(self, kill: KillCursors | None) -> None:
        """The stream was dropped unclosed: clean up later, without I/O (or awaiting) now.

        A load-balanced cursor lives on its pinned connection: no killCursors is
        queued for another connection, the pin is left to PyMongo.
        """
        session, self._session = self._session, None
        if self._pin is not None:
            self._pin = None
            kill = None
        _abandon(self._client, session, self._owns_session, kill)


class SyncTransport(_Transport):
    """Runs commands for one stream on a ``MongoClient`` with the stream's single session."""

    def __init__(
        self,
        client: MongoClient[Any],
        session: ClientSession | None,
        reply_codec: CodecOptions[Any] = _RAW,
    ) -> None:
        super().__init__(client, session, reply_codec)

    @property
    def session(self) -> ClientSession | None:
        return self._session  # type: ignore[no-any-return]

    def run(self, command: Command) -> CommandResult:
        """Run one command; PyMongo (and other ``Exception``) failures come back as ``ErrorInfo``."""
        wire_version: int | None = None
        try:
            route = _route(self._client, command)
            checkout = self._take_pin(route)
            if checkout is None:
                self._release()
                self._check_credentials(command)
                server = self._client._select_server(
                    route.selector, self._session, route.operation, address=route.address
                )
                checkout = self._checkout(server, contextlib.ExitStack())
                checkout.conn, checkout.read_preference = checkout.stack.enter_context(
                    self._context(route, server)
                )
            with checkout.stack:
                conn = checkout.conn
                wire_version = conn.max_wire_version
                try:
                    reply = conn.command(command.database, route.spec,
                                         **self._command_kwargs(route, checkout.read_preference))
                except (OperationFailure, NotPrimaryError) as exc:
                    raise _with_dict_details(exc, wire_version) from exc
                self._keep(checkout, command, reply)
            return self._reply(reply, checkout, conn.max_wire_version)
        except Exception as exc:
            return error_info(exc, wire_version)

    def run_aside(self, kill: KillCursors) -> None:
        """Best effort: ``kill`` on a connection of its own, without the stream's session, while
        the stream's getMore waits on another (a close from another thread: the server then
        interrupts that getMore). Bounded by :data:`ASIDE_TIMEOUT` (a close must not hang on
        an unreachable server); a failure is logged (debug) and left to the close that
        follows, which kills the cursor after the getMore returns."""
        try:
            with pymongo.timeout(ASIDE_TIMEOUT):
                route = _route(self._client, kill)
                server = self._client._select_server(route.selector, None, route.operation,
                                                     address=route.address)
                with self._client._conn_from_server(route.selector, server, None) as (
                    conn, read_pref
                ):
                    conn.command(kill.database, route.spec,
                                 **self._aside_kwargs(route, read_pref))
        except Exception as exc:
            _aside_failed(kill, exc)

    def _release(self) -> None:
        """Check in a pinned connection (load-balanced mode)."""
        pin, self._pin = self._pin, None
        if pin is not None:
            pin.stack.close()

    def close(self) -> None:
        """Release a pin; end the implicit session (a caller's session is left alone)."""
        self._release()
        session = self._end_owned_session()
        if session is not None:
            session.end_session()


class AsyncTransport(_Transport):
    """:class:`SyncTransport` for an ``AsyncMongoClient``: the same routing, awaited."""

    def __init__(
        self,
        client: AsyncMongoClient[Any],
        session: AsyncClientSession | None,
        reply_codec: CodecOptions[Any] = _RAW,
    ) -> None:
        super().__init__(client, session, reply_codec)

    @property
    def session(self) -> AsyncClientSession | None:
        return self._session  # type: ignore[no-any-return]

    async def run(self, command: Command) -> CommandResult:
        """Run one command; PyMongo (and other ``Exception``) failures come back as ``ErrorInfo``.

        Cancellation (``CancelledError``) is not an ``Exception`` and propagates.
        """
        wire_version: int | None = None
        try:
            route = _route(self._client, command)
            checkout = self._take_pin(route)
            if checkout is None:
                await self._release()
                self._check_credentials(command)
                server = await self._client._select_server(
                    route.selector, self._session, route.operation, address=route.address
                )
                checkout = self._checkout(server, contextlib.AsyncExitStack())
                checkout.conn, checkout.read_preference = await checkout.stack.enter_async_context(
                    self._context(route, server)
                )
            async with checkout.stack:
                conn = checkout.conn
                wire_version = conn.max_wire_version
                try:
                    reply = await conn.command(command.database, route.spec,
                                               **self._command_kwargs(route, checkout.read_preference))
                except (OperationFailure, NotPrimaryError) as exc:
                    raise _with_dict_details(exc, wire_version) from exc
                self._keep(checkout, command, reply)
            return self._reply(reply, checkout, conn.max_wire_version)
        except Exception as exc:
            return error_info(exc, wire_version)

    async def run_aside(self, kill: KillCursors) -> None:
        """:meth:`SyncTransport.run_aside`, awaited."""
        try:
            with pymongo.timeout(ASIDE_TIMEOUT):
                route = _route(self._client, kill)
                server = await self._client._select_server(route.selector, None, route.operation,
                                                           address=route.address)
                async with self._client._conn_from_server(route.selector, server, None) as (
                    conn, read_pref
                ):
                    await conn.command(kill.database, route.spec,
                                       **self._aside_kwargs(route, read_pref))
        except Exception as exc:
            _aside_failed(kill, exc)

    async def _release(self) -> None:
        """Check in a pinned connection (load-balanced mode)."""
        pin, self._pin = self._pin, None
        if pin is not None:
            await pin.stack.aclose()

    async def close(self) -> None:
        """Release a pin; end the implicit session (a caller's session is left alone)."""
        await self._release()
        session = self._end_owned_session()
        if session is not None:
            await session.end_session()


class _CursorRoutes:
    """Where each command of plain cursors goes; shared by both cursor readers (no I/O).

    A command that opens a cursor (``aggregate``, ``find``, ``listCollections``, ...)
    selects a server as ``Database.command`` does (primary; any mongos); the reply's
    cursor id is remembered with the server it came from, and that cursor's
    ``getMore`` and ``killCursors`` go to that server only.
    """

    def __init__(self, database: str) -> None:
        self._database = database
        self._addresses: dict[int, Any] = {}

    def command(self, body: Mapping[str, Any]) -> Command:
        """The transport's command for ``body`` (a getMore or killCursors of a cursor opened
        here goes to its server; any other command selects one)."""
        name = next(iter(body), None)
        if name == "getMore":
            address = self._addresses.get(int(body["getMore"]))
            if address is not None:
                return RunGetMore(dict(body), self._database, address)
        elif name == "killCursors":
            cursors: list[Any] = list(body.get("cursors") or [])
            address = self._addresses.get(int(cursors[0])) if len(cursors) == 1 else None
            if address is not None:
                return KillCursors(dict(body), self._database, address)
        return RunAggregate(dict(body), self._database, ReadPreference.PRIMARY, None, False)

    def reply(self, command: Command, result: CommandResult) -> Mapping[str, Any]:
        """The reply (its cursor's server remembered while it lives), or the error raised."""
        if isinstance(command, RunGetMore):
            self._addresses.pop(int(command.command["getMore"]), None)
        elif isinstance(command, KillCursors):
            self._addresses.pop(int(command.command["cursors"][0]), None)
        if isinstance(result, ErrorInfo):
            raise result.exception
        reply, info = result
        cursor = reply.get("cursor")
        cursor_id = cursor.get("id") if isinstance(cursor, Mapping) else None
        if cursor_id and not isinstance(command, KillCursors):
            self._addresses[int(cursor_id)] = info.address
        return reply


class SyncCursorReader:
    """``reader(command) -> reply`` in ``session``, each cursor's getMore and killCursors on
    the server that opened it (a snapshot copy's ``read``; see the module docstring).

    Replies are decoded with ``codec_options`` (``Database.command``'s default unless
    given); a server error raises as from ``Database.command``. :meth:`close` releases
    a load-balanced pin (the session is the caller's).
    """

    def __init__(self, database: Any, session: ClientSession,
                 codec_options: CodecOptions[Any] = DEFAULT_CODEC_OPTIONS) -> None:
        self._transport = SyncTransport(database.client, session, codec_options)
        self._routes = _CursorRoutes(database.name)

    def __call__(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        command = self._routes.command(body)
        return self._routes.reply(command, self._transport.run(command))

    def close(self) -> None:
        self._transport.close()


class AsyncCursorReader:
    """:class:`SyncCursorReader` for an ``AsyncDatabase``, awaited."""

    def __init__(self, database: Any, session: AsyncClientSession,
                 codec_options: CodecOptions[Any] = DEFAULT_CODEC_OPTIONS) -> None:
        self._transport = AsyncTransport(database.client, session, codec_options)
        self._routes = _CursorRoutes(database.name)

    async def __call__(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        command = self._routes.command(body)
        return self._routes.reply(command, await self._transport.run(command))

    async def close(self) -> None:
        await self._transport.close()
