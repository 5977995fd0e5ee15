"""Sharded clusters in the simulator: mongos, its change-stream merge, a load balancer."""

from __future__ import annotations

from .cluster import ShardedCluster

__all__ = ["ShardedCluster"]
