"""Role changes of a replica set's members, and the condition awaitable hellos wait on.

Everything here acts on one deployment: its :attr:`topology_changed` condition
wakes only that deployment's waiting hellos.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bson.int64 import Int64
from bson.objectid import ObjectId

if TYPE_CHECKING:
    from ..storage.deployment import Deployment, Member


def topology_version(member: Member) -> dict[str, Any]:
    """``{processId, counter}`` of ``member``."""
    return {"processId": member.process_id, "counter": Int64(member.topology_counter)}


def notify_topology_change(deployment: Deployment) -> None:
    """Wake every awaitable hello of ``deployment`` so it re-checks its member's topologyVersion."""
    with deployment.topology_changed:
        deployment.topology_changed.notify_all()


def elect_next(deployment: Deployment, *, restart_old: bool = False) -> Member | None:
    """Step the primary down and elect the next member that is up (itself if alone): term + 1.

    Every member's topologyVersion counter moves (their hello replies all
    change), the new primary writes mongod's "new primary" no-op, and waiting
    hellos wake. ``restart_old`` also gives the old primary a new processId
    and clears its failpoints, as a restarted mongod has. With no member up,
    the set is left without a primary (None). Caller holds ``deployment.lock``.
    """
    members = deployment.members
    old = deployment.primary
    start = old.index + 1 if old is not None else 0
    rotation = [members[(start + i) % len(members)] for i in range(len(members))]
    new = next((m for m in rotation if m.up), None)
    deployment.term += 1
    deployment.primary = new
    for member in members:
        member.topology_counter += 1
    if restart_old and old is not None:
        old.process_id = ObjectId()
        old.topology_counter = 0
        old.failpoints.reset()
    if new is not None:
        deployment.log("n", "", {"msg": "new primary"})
    notify_topology_change(deployment)
    return new
