"""A token from another deployment, or older than the oplog, never resumes silently
(issue 22, deliverable 4).

mongod (``document_source_change_stream_check_resumability.cpp``): a resume point older than
the oldest oplog entry fails with ChangeStreamHistoryLost (286) at the aggregate, unless that
entry is the set's "initiating set" no-op (then no event older can have existed); a token that
is not in the stream fails with ChangeStreamFatalError (280) once an event after it passes
(``document_source_change_stream_ensure_resume_token_present.cpp``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from changestream.testing import ReplicaSet
from changestream.testing.core.clock import ClusterClock

Client = MongoClient[dict[str, Any]]
StartRs = Callable[..., ReplicaSet]
Clients = Callable[..., Client]


def _token_of(rs: ReplicaSet, clients: Clients) -> dict[str, Any]:
    client = clients(rs.uri)
    with client.db.c.watch() as stream:
        client.db.c.insert_one({"_id": "from A"})
        next(stream)
        token = stream.resume_token
    assert token is not None
    return dict(token)


def _aggregate(client: Client, token: dict[str, Any]) -> dict[str, Any]:
    return client.db.command(
        "aggregate", "c", pipeline=[{"$changeStream": {"resumeAfter": token}}], cursor={}
    )


def test_a_token_older_than_the_oplog_fails_at_the_aggregate(
    start_rs: StartRs, clients: Clients
) -> None:
    token = _token_of(start_rs("8.0", noop_interval=0), clients)
    other = start_rs("8.0", noop_interval=0, oplog_max_entries=4)
    client = clients(other.uri)
    client.db.c.insert_many([{"_id": i} for i in range(10)])  # the oplog no longer reaches back
    with pytest.raises(OperationFailure) as exc:
        _aggregate(client, token)
    assert exc.value.code == 286
    assert exc.value.details is not None
    assert exc.value.details["codeName"] == "ChangeStreamHistoryLost"
    assert "NonResumableChangeStreamError" in exc.value.details.get("errorLabels", [])


def test_a_foreign_token_fails_once_the_other_deployment_has_an_event(
    start_rs: StartRs, clients: Clients
) -> None:
    token = _token_of(start_rs("8.0", noop_interval=0), clients)
    # B's clock runs a minute ahead, so its event is after A's token (within one second
    # both clocks would hand out times on either side of it)
    other = start_rs("8.0", noop_interval=0, clock=ClusterClock(lambda: time.time() + 60))
    client = clients(other.uri)
    client.db.c.insert_one({"_id": "from B"})
    with pytest.raises(OperationFailure) as exc, client.db.c.watch(resume_after=token) as stream:
        stream.try_next()
    assert exc.value.code == 280
    assert "the resume token was not found" in str(exc.value)
