"""Helpers shared by tests in every directory (imported by bare name: ``from support import ...``).

``tests/`` is on ``sys.path`` because pytest (default ``prepend`` import mode) inserts the
directory of ``tests/conftest.py``, which is always loaded before any test under ``tests/``.
Fixtures built on these helpers live in ``tests/conftest.py``.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import bson
import pytest
from pymongo import MongoClient, monitoring
from pymongo.errors import PyMongoError

if TYPE_CHECKING:
    from changestream.testing.core.context import CommandContext
    from changestream.testing.storage.deployment import Deployment as SimDeployment

STREAM_COMMANDS = ("aggregate", "getMore", "killCursors")
NEEDS_SIMULATOR = "needs the simulator (MONGODB_URI points at a real deployment)"


class Deployment:
    """Where the tests connect: the simulator (``sim`` set) or a real ``MONGODB_URI``."""

    def __init__(self, uri: str, sim: Any = None) -> None:
        self.uri = uri
        self.sim = sim

    def require_sim(self) -> Any:
        if self.sim is None:
            pytest.skip(NEEDS_SIMULATOR)
        return self.sim


def probe(uri: str) -> str | None:
    """Why the deployment cannot run change streams (``None``: it can)."""
    try:
        client: MongoClient[dict[str, Any]] = MongoClient(uri, serverSelectionTimeoutMS=5000)
        with client:
            coll = client[f"probe_{uuid.uuid4().hex[:8]}"]["c"]
            with coll.watch(max_await_time_ms=200) as stream:
                coll.insert_one({"probe": 1})
                change = stream.try_next() or stream.try_next()
            client.drop_database(coll.database.name)
            if change is None or change.get("operationType") != "insert":
                return f"a change stream did not report an insert (got {change!r})"
    except PyMongoError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class Recorder(monitoring.CommandListener):
    """Records started/succeeded stream commands; ``on_success`` runs inside the driver call."""

    def __init__(self) -> None:
        self.events: list[monitoring.CommandStartedEvent] = []
        self.replies: list[tuple[str, Any]] = []
        self.on_success: Callable[[monitoring.CommandSucceededEvent], None] | None = None

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in STREAM_COMMANDS:
            self.events.append(event)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name in STREAM_COMMANDS:
            self.replies.append((event.command_name, event.reply))
            if self.on_success is not None:
                self.on_success(event)

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def names(self) -> list[str]:
        return [e.command_name for e in self.events]

    def commands(self, name: str) -> list[Any]:
        return [e.command for e in self.events if e.command_name == name]

    def stage(self, index: int = -1) -> dict[str, Any]:
        result: dict[str, Any] = self.commands("aggregate")[index]["pipeline"][0]["$changeStream"]
        return result

    def last_pbrt(self) -> Any:
        """The postBatchResumeToken of the latest aggregate/getMore reply, as a dict."""
        replies = [r for name, r in self.replies if name != "killCursors"]
        return plain(replies[-1]["cursor"]["postBatchResumeToken"])

    def clear(self) -> None:
        self.events.clear()
        self.replies.clear()


def plain(value: Any) -> Any:
    """``value`` with every RawBSONDocument/SON decoded to plain dicts (for comparisons)."""
    return bson.decode(bson.encode({"v": value}))["v"]


def raw_command(member: str, body: dict[str, Any]) -> dict[str, Any]:
    """Run one OP_MSG command without a driver (so without an implicit ``lsid`` or
    ``$readPreference``)."""
    payload = bson.encode(body)
    host, port = member.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(struct.pack("<iiiiIB", 21 + len(payload), 1, 0, 2013, 0, 0) + payload)
        data = b""
        while len(data) < 4 or len(data) < int.from_bytes(data[:4], "little"):
            data += sock.recv(65536)
    return bson.decode(data[21:])


def command_context(deployment: SimDeployment, db: str, body: dict[str, Any]) -> CommandContext:
    """What a simulator command handler receives for ``body`` on the first member."""
    from changestream.testing.core.context import CommandContext, ConnectionInfo

    return CommandContext(
        deployment=deployment,
        member=deployment.members[0],
        connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db=db,
        name=next(iter(body)),
        body=body,
    )


def interrupt_as_a_getmore_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on (until ``monkeypatch.undo()``), a ``KeyboardInterrupt`` right after the
    stream's machine chooses a getMore, before the shell sends it: where a signal handled
    between two bytecodes lands."""
    from changestream._machine import ChangeStreamMachine, RunGetMore

    next_action = ChangeStreamMachine.next_action

    def interrupted_after(machine: ChangeStreamMachine) -> Any:
        action = next_action(machine)
        if isinstance(action, RunGetMore):
            raise KeyboardInterrupt
        return action

    monkeypatch.setattr(ChangeStreamMachine, "next_action", interrupted_after)


@dataclasses.dataclass
class Ctx:
    """What a scenario gets (the ``run`` fixture): the observed client and collection, helpers.

    An ``async def`` scenario gets an ``AsyncMongoClient``, a plain one a ``MongoClient``
    (so one asyncio test and its generated sync twin read the same); writes and
    failpoints always go through the unobserved sync client.
    """

    deployment: Deployment
    client: Any
    """The observed ``MongoClient`` or ``AsyncMongoClient`` the streams run on."""
    coll: Any
    """The observed collection the streams watch (of :attr:`client`)."""
    writer: Any
    """The same collection through an unobserved sync client."""
    admin: MongoClient[dict[str, Any]]
    recorder: Recorder

    def fail_point(self, name: str, mode: Any, **data: Any) -> None:
        self.admin.admin.command({"configureFailPoint": name, "mode": mode, "data": data})

    def resumable_getmore_failure(self) -> None:
        """One getMore fails with a resumable error (the label is computed server-side)."""
        self.fail_point("failGetMoreAfterCursorCheckout", {"times": 1}, errorCode=6)


Scenario = Callable[[Ctx], "Awaitable[None] | None"]
