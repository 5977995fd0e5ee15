"""``setFeatureCompatibilityVersion``: what a v2 change stream's FCV fallback needs.

The FCV decides whether mongos reads change streams with precise shard targeting (v2, FCV
9.0+, ``featureFlagChangeStreamPreciseShardTargeting``). Only the FCV value changes here:
no feature of the simulator but that one depends on it.
"""

from __future__ import annotations

from typing import Any

from ..core.context import CommandContext
from ..core.errors import CommandError
from ..core.versions import VERSIONS, VersionProfile, fcv_tuple
from ..storage import type_name
from .spec import command


def valid_fcvs(profile: VersionProfile) -> list[str]:
    """The values ``setFeatureCompatibilityVersion`` accepts: latest, lastContinuous,
    lastLTS, without repeats (``feature_compatibility_version_parser.cpp``'s
    ``validFcvVersions``).

    Derived from the emulated lines: lastContinuous is the line before this one, lastLTS
    the newest ``x.0`` line before it. Where mongod's lastContinuous is a release the
    simulator does not emulate (8.0's 7.3), only latest and lastLTS are accepted."""
    latest = profile.major_minor
    older = sorted(
        (p for p in VERSIONS.values() if p.major_minor < latest), key=lambda p: p.major_minor
    )
    lts = [p for p in older if p.major_minor[1] == 0]
    return list(dict.fromkeys(p.fcv for p in [profile, *older[-1:], *lts[-1:]]))


def requested_fcv(profile: VersionProfile, body: dict[str, Any], current: str) -> str | None:
    """The FCV a ``setFeatureCompatibilityVersion`` asks for (None: already there).

    In mongod's order: the value is parsed (14 for a wrong type; 4926900 for a value that is
    not one of :func:`valid_fcvs`), then ``confirm: true`` is required from 7.0 (7369100,
    also when the value is the current one), then an unchanged FCV is a no-op
    (``set_feature_compatibility_version_command.cpp``)."""
    value = body.get("setFeatureCompatibilityVersion")
    if not isinstance(value, str):
        raise CommandError(
            14,
            "BSON field 'setFeatureCompatibilityVersion.setFeatureCompatibilityVersion' is the "
            f"wrong type '{type_name(value)}', expected type 'string'",
        )
    allowed = valid_fcvs(profile)
    if value not in allowed:
        # mongod's text, its stray quote before the list included
        lts = allowed[-1]
        raise CommandError(
            4926900,
            f"Invalid feature compatibility version value '{value}'. Expected one of the "
            "following versions: '" + ", ".join(f"'{v}'" for v in allowed) + ". See "
            f"https://docs.mongodb.com/master/release-notes/{lts}-compatibility/"
            "#feature-compatibility.",
        )
    if profile.major_minor >= (7, 0) and body.get("confirm") is not True:
        upgrade = fcv_tuple(value) > fcv_tuple(current)
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
    return None if value == current else value


@command("setFeatureCompatibilityVersion", admin_only=True, locks=False)
def set_fcv(ctx: CommandContext) -> dict[str, Any]:
    deployment = ctx.deployment
    version = requested_fcv(deployment.profile, ctx.body, deployment.fcv)
    if version is not None:
        deployment.fcv = version
    return {}
