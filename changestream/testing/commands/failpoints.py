"""``configureFailPoint`` and ``waitForFailPoint`` (test commands, admin database only)."""

from __future__ import annotations

import time
from typing import Any

from ..core.context import CLIENT_CHECK_SECONDS, CommandContext
from ..core.errors import CommandError
from .spec import command


@command("configureFailPoint", admin_only=True, locks=False, any_member=True)
def configure_fail_point(ctx: CommandContext) -> dict[str, Any]:
    """Set a failpoint of the member that received the command; reply its previous count."""
    name = ctx.target
    if not isinstance(name, str):
        raise CommandError(14, "configureFailPoint must be a string")
    count = ctx.member.failpoints.configure(name, ctx.body.get("mode"), ctx.body.get("data"))
    return {"count": count}


@command("waitForFailPoint", admin_only=True, locks=False, any_member=True)
def wait_for_fail_point(ctx: CommandContext) -> dict[str, Any]:
    """Wait until a failpoint was entered ``timesEntered`` times in all (needs ``maxTimeMS``)."""
    name = ctx.target
    if not isinstance(name, str):
        raise CommandError(14, "waitForFailPoint must be a string")
    times = ctx.body.get("timesEntered")
    if not isinstance(times, int) or isinstance(times, bool):
        raise CommandError(
            40414, "BSON field 'waitForFailPoint.timesEntered' is missing but a required field"
        )
    if not ctx.max_time_ms:
        raise CommandError(
            40414, "BSON field 'waitForFailPoint.maxTimeMS' is missing but a required field"
        )
    deadline = time.monotonic() + ctx.max_time_ms / 1000
    while True:  # in slices, to notice a client that left (it has nothing left to wait for)
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommandError(50, "operation exceeded time limit")
        if ctx.member.failpoints.wait_for(name, times, min(left, CLIENT_CHECK_SECONDS)):
            return {}
        ctx.connection.check_connected()
