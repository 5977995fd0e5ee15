"""CSOT prose test 5, "Blocking Iteration Methods - Change Streams" (csot/tests/README.md).

With every getMore blocked for 15 ms and a client ``timeoutMS`` of 20, a
blocking ``next()`` must fail with a timeout error: the 20 ms cover the whole
loop of getMores, not each one.

The README expects exactly two getMores. That needs the first getMore to
return within the 5 ms left after the block, but the CSOT spec (and the
unified test "timeoutMS is refreshed for getMore if maxAwaitTimeMS is not
set") forbids ``maxTimeMS`` on the getMore here, so the server's awaitData
wait (1 s by default on mongod) outlasts the deadline and a compliant client
sees one getMore. Like the Java driver's version of this test, we accept one
or two getMores, and also require ``next()`` to fail well before the 1 s
awaitData wait would have ended.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from pymongo import AsyncMongoClient, MongoClient

from spec_tests.runner.adapter import needs_bridge, open_change_stream
from spec_tests.runner.async_bridge import AsyncBridge
from spec_tests.runner.errors import describe, is_timeout
from spec_tests.runner.events import EventRecorder
from spec_tests.runner.executor import fast_sdam
from spec_tests.runner.gc_pauses import no_gc_pauses
from spec_tests.runner.operations import next_with_limit
from spec_tests.runner.targets import Target

BLOCKING_GETMORE = {
    "configureFailPoint": "failCommand",
    "mode": "alwaysOn",
    "data": {"failCommands": ["getMore"], "blockConnection": True, "blockTimeMS": 15},
}


@pytest.fixture
def csot_target(spec_target: Target) -> Target:
    info = spec_target.info
    if info.version < (4, 4, 0):
        pytest.skip(f"CSOT prose tests need MongoDB >= 4.4 (server is {info.version_text})")
    if info.topology not in ("replicaset", "sharded"):
        pytest.skip(f"change streams need a replica set or sharded cluster, not {info.topology}")
    return spec_target


@pytest.fixture
def blocked_getmores(csot_target: Target) -> Iterator[None]:
    internal = csot_target.internal
    internal["db"].drop_collection("coll")
    internal.admin.command(BLOCKING_GETMORE)
    try:
        yield
    finally:
        internal.admin.command({"configureFailPoint": "failCommand", "mode": "off"})
        internal["db"].drop_collection("coll")


async def _ping(client: AsyncMongoClient[Any]) -> None:
    with pymongo.timeout(10):
        await client.admin.command("ping")


@no_gc_pauses()  # a full collection of this process takes longer than the 20 ms budget
def test_blocking_next_times_out_across_getmores(
    csot_target: Target, blocked_getmores: None, spec_client_impl: str
) -> None:
    recorder = EventRecorder(["commandStartedEvent", "commandSucceededEvent"], [])
    options: dict[str, Any] = {
        "timeoutMS": 20,
        "w": "majority",
        "readConcernLevel": "majority",
        "readPreference": "primary",
        "event_listeners": [recorder],
    }
    with fast_sdam():
        client: MongoClient[dict[str, Any]] = MongoClient(csot_target.uri, **options)
    bridge = AsyncBridge() if needs_bridge(spec_client_impl) else None
    stream = None
    try:
        # Connect and select the server outside the 20 ms budget (the async mirror too).
        with pymongo.timeout(10):
            client.admin.command("ping")
        if bridge is not None:
            with fast_sdam():
                bridge.register(client, csot_target.uri, options)
            bridge.run(_ping(bridge.mirror(client)))
        recorder.events.clear()
        stream = open_change_stream(client["db"]["coll"], {}, spec_client_impl, bridge)
        aggregates = [
            o
            for o in recorder.snapshot()
            if o.kind == "commandSucceededEvent" and o.event.command_name == "aggregate"
        ]
        assert aggregates, "watch() did not run an aggregate"
        assert aggregates[-1].event.reply["cursor"]["id"] != 0, "the change stream has no cursor"

        started = time.monotonic()
        try:
            change = next_with_limit(stream, 10.0)
        except Exception as exc:  # any error type, as long as it is a timeout
            assert is_timeout(exc), f"expected a timeout error, got {describe(exc)}"
        else:
            pytest.fail(f"next() returned {change!r} instead of timing out")
        elapsed = time.monotonic() - started
        assert elapsed < 0.5, f"next() took {elapsed:.3f} s to time out with timeoutMS=20"
    finally:
        recorder.enabled = False
        if stream is not None:
            stream.close()
        client.close()
        if bridge is not None:
            assert bridge.close() == []

    sent = [
        o.event.command_name
        for o in recorder.snapshot()
        if o.kind == "commandStartedEvent" and o.event.database_name == "db" and _on_coll(o.command)
    ]
    assert sent in (["aggregate", "getMore"], ["aggregate", "getMore", "getMore"]), (
        f"commands against db.coll: {sent} (expected one aggregate, then one or two getMores)"
    )


def _on_coll(command: dict[str, Any] | None) -> bool:
    """aggregate or getMore against db.coll (killCursors is not counted)."""
    command = command or {}
    return command.get("aggregate") == "coll" or (
        "getMore" in command and command.get("collection") == "coll"
    )
