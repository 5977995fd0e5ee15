"""Helpers for the async tests (imported by ``conftest.py`` and the test modules).

``Deployment``, ``Recorder`` and ``plain`` are shared with the sync tests: see ``tests/support.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo import AsyncMongoClient, MongoClient
from support import Deployment, Recorder


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


