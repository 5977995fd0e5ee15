"""Cluster time: the ``Timestamp(seconds, increment)`` every write is stamped with.

Clients gossip ``$clusterTime`` back, and mongod trusts it only so far
(``vector_clock.cpp``, ``logical_time_validator.cpp``): a time more than
``maxAcceptableLogicalClockDriftSecs`` (one year by default) ahead of the wall
clock fails with ClusterTimeFailsRateLimiter (205), one beyond the largest
signed 32-bit seconds or increment with 40484. With authentication on, the
cluster time is signed (HMAC-SHA1 with a key of the cluster): a client that is
not authenticated and sends an unsigned time is ignored, any other time must
carry a valid proof (KeyNotFound 211, TimeProofMismatch 204).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from bson.binary import Binary
from bson.int64 import Int64
from bson.timestamp import Timestamp

from .errors import CommandError

ZERO_SIGNATURE_HASH = b"\x00" * 20
MAX_ACCEPTABLE_DRIFT_SECS = 365 * 24 * 60 * 60
"""mongod's ``maxAcceptableLogicalClockDriftSecs`` default."""
MAX_TIME_PART = 2**31 - 1
"""The largest seconds and increment a cluster time may reach (mongod's ``kMaxSignedInt``)."""


class ClusterClock:
    """Hands out strictly increasing oplog timestamps, as mongod's LogicalClock does.

    Seconds follow the wall clock; the increment counts writes within a second.
    ``advance`` takes gossiped ``$clusterTime`` values (never goes backwards).
    """

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self._now = now
        self._lock = threading.Lock()
        secs = int(now())
        self._last = Timestamp(secs, 1)
        self._key = os.urandom(20)
        """The HMAC key signing this cluster's time when authentication is on."""
        self.key_id = Int64(int.from_bytes(os.urandom(6), "big") | 1)
        self.max_drift_secs = MAX_ACCEPTABLE_DRIFT_SECS

    def tick(self) -> Timestamp:
        """Reserve and return the next timestamp."""
        with self._lock:
            secs = int(self._now())
            if secs > self._last.time:
                self._last = Timestamp(secs, 1)
            else:
                self._last = Timestamp(self._last.time, self._last.inc + 1)
            return self._last

    def current(self) -> Timestamp:
        """The latest timestamp handed out (the cluster time to gossip)."""
        with self._lock:
            return self._last

    def advance(self, ts: Timestamp) -> None:
        """Move forward to a cluster time this process trusts (its own, restored) if it is ahead."""
        with self._lock:
            if (ts.time, ts.inc) > (self._last.time, self._last.inc):
                self._last = ts

    def gossip_in(self, doc: Any, *, auth: bool, authenticated: bool) -> None:
        """Take a client's ``$clusterTime`` as mongod does, or fail the command.

        ``auth``: the deployment requires authentication (the time is signed);
        ``authenticated``: the client has logged in.
        """
        if not isinstance(doc, dict):
            return
        ts = doc.get("clusterTime")
        if not isinstance(ts, Timestamp):
            return
        if auth:
            signature = doc.get("signature")
            proof = signature.get("hash") if isinstance(signature, dict) else None
            key_id = signature.get("keyId") if isinstance(signature, dict) else None
            unsigned = not isinstance(proof, bytes) or bytes(proof) == ZERO_SIGNATURE_HASH
            if unsigned and not authenticated:
                return  # an unauthenticated client's unsigned time is not gossiped in
            if key_id != self.key_id:
                raise CommandError(
                    211, f"No keys found for HMAC that is valid for time: {_show(ts)} with id: "
                    f"{key_id}"
                )  # fmt: skip
            if not isinstance(proof, bytes) or not hmac.compare_digest(
                bytes(proof), self._sign(ts)
            ):
                raise CommandError(204, "Proof does not match the cluster time")
        wall = int(self._now())
        if ts.time > wall and ts.time - wall > self.max_drift_secs:
            raise CommandError(
                205, f"New $clusterTime, {ts.time}, is too far from this node's wall clock time, "
                f"{wall}."
            )  # fmt: skip
        if ts.time > MAX_TIME_PART or ts.inc > MAX_TIME_PART:
            raise CommandError(40484, "$clusterTime cannot be advanced beyond its maximum value")
        self.advance(ts)

    def _sign(self, ts: Timestamp) -> bytes:
        return hmac.digest(self._key, struct.pack(">II", ts.time, ts.inc), hashlib.sha1)

    def wall(self) -> datetime:
        """Wall-clock time with millisecond precision (what BSON dates keep)."""
        now = self._now()
        ms = int(now * 1000)
        return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)

    def cluster_time_doc(self, *, signed: bool = False) -> dict[str, object]:
        """The ``$clusterTime`` document: signed with the cluster's key when authentication
        is on (``signed``), dummy-signed (zero hash, key 0) as mongod without it."""
        now = self.current()
        if not signed:
            return {
                "clusterTime": now,
                "signature": {"hash": Binary(ZERO_SIGNATURE_HASH, 0), "keyId": Int64(0)},
            }
        return {
            "clusterTime": now,
            "signature": {"hash": Binary(self._sign(now), 0), "keyId": self.key_id},
        }


def _show(ts: Timestamp) -> str:
    return f"{{ ts: Timestamp({ts.time}, {ts.inc}) }}"
