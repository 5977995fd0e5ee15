"""Helpers shared by the async tests (imported by ``conftest.py`` and the test modules)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import bson
import pytest
from pymongo import AsyncMongoClient, MongoClient, monitoring

STREAM_COMMANDS = ("aggregate", "getMore", "killCursors")


class Deployment:
    """Where the tests connect: the simulator (``sim`` set) or a real ``MONGODB_URI``."""

    def __init__(self, uri: str, sim: Any = None) -> None:
        self.uri = uri
        self.sim = sim

    def require_sim(self) -> Any:
        if self.sim is None:
            pytest.skip("needs the simulator (MONGODB_URI points at a real deployment)")
        return self.sim


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
        replies = [r for name, r in self.replies if name != "killCursors"]
        return plain(replies[-1]["cursor"]["postBatchResumeToken"])

    def clear(self) -> None:
        self.events.clear()
        self.replies.clear()


def plain(value: Any) -> Any:
    """``value`` with every RawBSONDocument/SON decoded to plain dicts (for comparisons)."""
    return bson.decode(bson.encode({"v": value}))["v"]


@dataclasses.dataclass
class Ctx:
    """What a scenario gets: the observed async client and collection, sync helpers."""

    deployment: Deployment
    client: AsyncMongoClient[dict[str, Any]]
    coll: Any
    """The observed ``AsyncCollection`` the streams watch."""
    writer: Any
    """The same collection through an unobserved sync client."""
    admin: MongoClient[dict[str, Any]]
    recorder: Recorder

    def fail_point(self, name: str, mode: Any, **data: Any) -> None:
        self.admin.admin.command({"configureFailPoint": name, "mode": mode, "data": data})

    def resumable_getmore_failure(self) -> None:
        """One getMore fails with a resumable error (the label is computed server-side)."""
        self.fail_point("failGetMoreAfterCursorCheckout", {"times": 1}, errorCode=6)


Scenario = Callable[[Ctx], Awaitable[None]]


