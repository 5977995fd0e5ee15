"""A wire-level MongoDB replica-set simulator for tests (``changestream.testing``).

Any MongoDB driver can connect to it: it speaks OP_MSG on loopback and
emulates mongod 4.2 to 9.1 change streams, failpoints and failover. It
imports nothing from the ``changestream`` client.
"""

from __future__ import annotations

from .core.versions import DEFAULT_VERSION, VERSIONS, VersionProfile, get_profile
from .replset import ReplicaSet
from .sharding import ShardedCluster

__all__ = [
    "DEFAULT_VERSION",
    "VERSIONS",
    "ReplicaSet",
    "ShardedCluster",
    "VersionProfile",
    "get_profile",
]
