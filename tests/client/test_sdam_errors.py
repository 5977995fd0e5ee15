"""Server errors must reach PyMongo's SDAM exactly as PyMongo's own operations deliver them.

Replies are read raw (tokens stay byte-exact); an error whose ``details`` stayed
raw defeated PyMongo's stale-error check, marked a healthy primary Unknown and
stalled the resume until the next heartbeat (10 s by default).
"""

from __future__ import annotations

import time
from typing import Any

import bson
import pytest
from bson.raw_bson import RawBSONDocument
from pymongo import MongoClient
from pymongo.errors import NotPrimaryError, OperationFailure

import changestream
from changestream._pymongo import _with_dict_details


def _resume_after_get_more_error(
    uri: str, code: int, **client_options: Any
) -> tuple[Any, float, int]:
    """The change, the seconds the resume took and the resume count, after one failed getMore."""
    client: MongoClient[dict[str, Any]] = MongoClient(uri, **client_options)  # heartbeat: 10 s
    try:
        coll = client.db.coll
        coll.insert_one({"_id": 0})
        with changestream.watch(coll) as stream:
            client.admin.command(
                "configureFailPoint",
                "failGetMoreAfterCursorCheckout",
                mode={"times": 1},
                data={"errorCode": code},
            )
            coll.insert_one({"_id": 1})
            started = time.monotonic()
            change = stream.next()
            return change, time.monotonic() - started, stream.resumes
    finally:
        client.close()


# The NotPrimary family: mongod attaches ``topologyVersion`` to those errors, so PyMongo can see
# that the error is stale and keep the primary. A shutdown error (91, 11600) raised by a failpoint
# carries none (mongod's service_entry_point_common.cpp adds it to shutdown errors only in quiesce
# mode), so PyMongo marks the server Unknown and clears its pool by design, and the resume waits
# for the monitor's next check.
@pytest.mark.parametrize("code", [189, 10107, 13435])
def test_resume_after_a_labelled_not_primary_error_does_not_wait_for_a_heartbeat(
    simulator: Any, code: int
) -> None:
    change, elapsed, _ = _resume_after_get_more_error(simulator.uri, code)
    assert change["documentKey"] == {"_id": 1}
    assert elapsed < 3.0, f"resume took {elapsed:.1f}s: the primary was marked Unknown"


@pytest.mark.parametrize("code", [91, 11600])
def test_resume_after_a_shutdown_error_waits_for_the_monitor_only(simulator: Any, code: int) -> None:
    # A short heartbeat: the wait is PyMongo's, and only that the stream resumes is checked here.
    change, _, resumes = _resume_after_get_more_error(simulator.uri, code, heartbeatFrequencyMS=500)
    assert change["documentKey"] == {"_id": 1} and resumes == 1


def test_error_details_become_a_dict_with_code_and_labels() -> None:
    reply = {
        "ok": 0.0,
        "errmsg": "not primary",
        "code": 10107,
        "codeName": "NotWritablePrimary",
        "errorLabels": ["ResumableChangeStreamError"],
        "topologyVersion": {"processId": bson.ObjectId(), "counter": bson.Int64(0)},
    }
    raw = RawBSONDocument(bson.encode(reply))
    original = NotPrimaryError("not primary", raw)  # type: ignore[arg-type]
    rebuilt = _with_dict_details(original, 25)
    assert isinstance(rebuilt, NotPrimaryError)
    assert type(rebuilt.details) is dict
    assert rebuilt.details["topologyVersion"] == reply["topologyVersion"]
    assert rebuilt.has_error_label("ResumableChangeStreamError")


def test_an_error_that_already_has_dict_details_is_left_alone() -> None:
    error = OperationFailure("boom", 2, {"ok": 0.0, "code": 2, "errmsg": "boom"})
    assert _with_dict_details(error, 25) is error
