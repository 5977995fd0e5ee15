"""mongos's handshake: ``hello`` / ``isMaster`` (``msg: "isdbgrid"``, ``serviceId`` behind a
load balancer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...commands.admin import (
    LOGICAL_SESSION_TIMEOUT_MINUTES,
    MAX_BSON_OBJECT_SIZE,
    MAX_WRITE_BATCH_SIZE,
    auth_fields,
    await_topology_change,
    compression_offer,
)
from ...core.codec import MAX_MESSAGE_SIZE
from ...core.context import CommandContext
from ...core.errors import CommandError
from ...core.topology import topology_version
from .spec import router_command

if TYPE_CHECKING:
    from ..router import Router


@router_command("hello", locks=False, any_member=True, handshake=True, auth=False)
@router_command("isMaster", "ismaster", locks=False, any_member=True, handshake=True, auth=False)
def hello(router: Router, ctx: CommandContext) -> dict[str, Any]:
    """mongos's handshake: ``msg: "isdbgrid"``, no set name; ``serviceId`` behind a load balancer."""
    body, conn, member = ctx.body, ctx.connection, ctx.member
    profile = router.profile
    offered = compression_offer(ctx)  # the client metadata: taken by the dispatcher
    if ("topologyVersion" in body) != ("maxAwaitTimeMS" in body):
        raise CommandError(
            31368, "A request with a 'topologyVersion' must include 'maxAwaitTimeMS'"
        )
    if "topologyVersion" in body and profile.topology_version:
        await_topology_change(member, body["topologyVersion"], body["maxAwaitTimeMS"], conn)
    reply: dict[str, Any] = {}
    if body.get("helloOk") is not None:
        reply["helloOk"] = True
    reply["ismaster" if ctx.name in ("isMaster", "ismaster") else "isWritablePrimary"] = True
    reply["msg"] = "isdbgrid"
    if profile.topology_version:
        reply["topologyVersion"] = topology_version(member)
    reply["maxBsonObjectSize"] = MAX_BSON_OBJECT_SIZE
    reply["maxMessageSizeBytes"] = MAX_MESSAGE_SIZE
    reply["maxWriteBatchSize"] = MAX_WRITE_BATCH_SIZE
    reply["localTime"] = router.clock.wall()
    reply["logicalSessionTimeoutMinutes"] = LOGICAL_SESSION_TIMEOUT_MINUTES
    reply["connectionId"] = conn.id
    reply["minWireVersion"] = 0
    reply["maxWireVersion"] = profile.max_wire_version
    reply["readOnly"] = False
    if router.cluster.is_load_balanced(member.name, conn.id):  # the LB port serves LB clients only
        reply["serviceId"] = router.service_id
    if offered is not None:
        conn.compressors = member.compressors.negotiate(offered)
    if conn.compressors:
        reply["compression"] = list(conn.compressors)
    reply.update(auth_fields(ctx))
    return reply
