"""``setFeatureCompatibilityVersion``: what a v2 change stream's FCV fallback needs.

The FCV decides whether mongos reads change streams with precise shard targeting (v2, FCV
9.0+, ``featureFlagChangeStreamPreciseShardTargeting``). Only the FCV value changes here:
no feature of the simulator but that one depends on it.
"""

from __future__ import annotations

from typing import Any

from ..core.context import CommandContext
from ..core.errors import CommandError
from ..core.versions import VERSIONS, VersionProfile
from .spec import command

_OLDEST_FCV = (8, 0)
"""The simulator accepts FCVs from 8.0 (the last LTS before 9.0) up to its own version."""


def requested_fcv(profile: VersionProfile, body: dict[str, Any], current: str) -> str | None:
    """The FCV a ``setFeatureCompatibilityVersion`` asks for (None: already there).

    ``confirm: true`` is required from 7.0 (7369100, ``set_feature_compatibility_version_
    command.cpp``'s messages)."""
    value = body.get("setFeatureCompatibilityVersion")
    if not isinstance(value, str):
        raise CommandError(
            14,
            "BSON field 'setFeatureCompatibilityVersion.setFeatureCompatibilityVersion' is the "
            f"wrong type '{type(value).__name__}', expected type 'string'",
        )
    allowed = [v for v in VERSIONS if _OLDEST_FCV <= VERSIONS[v].major_minor <= profile.major_minor]
    if value not in allowed:
        raise CommandError(
            2, f"Invalid feature compatibility version value '{value}'; expected one of "
            + ", ".join(f"'{v}'" for v in allowed),
        )  # fmt: skip
    if value == current:
        return None
    if profile.major_minor >= (7, 0) and body.get("confirm") is not True:
        upgrade = VERSIONS[value].major_minor > VERSIONS[current].major_minor
        raise CommandError(
            7369100,
            f"Once you have upgraded to {value}, you will not be able to downgrade FCV and "
            "binary version without support assistance. Please re-run this command with "
            "'confirm: true' to acknowledge this and continue with the FCV upgrade."
            if upgrade
            else "Once you have downgraded the FCV, if you choose to downgrade the binary "
            "version, it will require support assistance. Please re-run this command with "
            "'confirm: true' to acknowledge this and continue with the FCV downgrade.",
        )
    return value


@command("setFeatureCompatibilityVersion", admin_only=True, locks=False)
def set_fcv(ctx: CommandContext) -> dict[str, Any]:
    deployment = ctx.deployment
    version = requested_fcv(deployment.profile, ctx.body, deployment.fcv)
    if version is not None:
        deployment.fcv = version
    return {}
