"""What each emulated server version has and lacks.

One frozen profile per release line, so every behaviour that differs between
releases is looked up here instead of being decided by version comparisons
scattered through the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VersionProfile:
    """Facts about one emulated mongod release line."""

    version: str
    """Full version string reported by ``buildInfo`` (e.g. ``"8.0.4"``)."""
    max_wire_version: int
    token_version: int
    """Default resume-token version: 1 for 4.2-6.0, 2 for 6.1+ (7.0, 8.x)."""
    wall_time: bool
    """``wallTime`` on change events (6.0+)."""
    v2_update_oplog: bool
    """``$v: 2`` update diffs, hence ``truncatedArrays`` (5.0+)."""
    resumable_label: bool
    """Server adds ``ResumableChangeStreamError`` to change-stream errors (4.4+)."""
    expanded_events: bool
    """``showExpandedEvents``, ``collectionUUID``, DDL events (6.0+)."""
    pre_post_images: bool
    """``changeStreamPreAndPostImages``, ``whenAvailable``/``required`` (6.0+)."""
    disambiguated_paths: bool
    """``updateDescription.disambiguatedPaths`` with showExpandedEvents (6.1+)."""
    ns_type: bool
    """``nsType`` on ``create`` events (8.1+)."""
    split_events: bool
    """``$changeStreamSplitLargeEvent`` (7.0+, and 6.0.9+ on the 6.0 line)."""
    any_type_comment: bool
    """``comment`` of any BSON type on aggregate, and comment on getMore (4.4+)."""
    topology_version: bool
    """``topologyVersion`` and awaitable/streaming hello (4.4+)."""
    rejects_op_query_commands: bool
    """OP_QUERY is only accepted for the hello/isMaster handshake (5.1+)."""
    invalidated_flag: bool
    """``cursor.invalidated: true`` on the batch that carries an invalidate (7.0+)."""
    bulk_write: bool
    """The ``bulkWrite`` command (8.0+)."""
    retried_stmt_ids: bool
    """``retriedStmtIds`` / ``retriedStmtId`` in replies to retried writes (6.0+, SERVER-60524)."""
    two_phase_index_builds: bool
    """Index builds on non-empty collections log ``startIndexBuild``/``commitIndexBuild`` (4.4+)."""
    quiesce_mode: bool
    """Shutdown starts in quiesce mode: hello fails with ShutdownInProgress (91) (5.0+)."""
    reader_version: bool
    """``$changeStream.version`` (``"v1"``/``"v2"``) is parsed (8.2+, SERVER-104755)."""
    show_commit_timestamp: bool
    """``$changeStream.showCommitTimestamp`` is parsed (8.2.1+; 8.2.0 refuses the field)."""
    expanded_fields_by_default: bool
    """8.2.0 alone: ``collectionUUID``, rename's ``operationDescription`` and
    ``disambiguatedPaths`` without ``showExpandedEvents`` (reverted in 8.2.1, SERVER-109626)."""
    ignore_removed_shards: bool
    """``$changeStream.ignoreRemovedShards`` is parsed (9.0+)."""
    precise_shard_targeting: bool
    """``featureFlagChangeStreamPreciseShardTargeting`` at FCV 9.0: mongos reads v2 (9.0+)."""
    large_event_metrics: bool
    """``metrics.changeStreams.largeEventsSplit/largeEventsFailed`` (SERVER-67699: 5.0.19,
    6.0.7, 7.0)."""
    option_metrics: bool
    """``serverStatus().metrics.changeStreams.option/scope/cursor/error`` on mongod (9.0+);
    before, only ``changeStreams.showExpandedEvents`` (7.1+)."""

    @property
    def major_minor(self) -> tuple[int, int]:
        major, minor = self.version.split(".")[:2]
        return int(major), int(minor)

    @property
    def fcv(self) -> str:
        """The ``featureCompatibilityVersion`` a new deployment of this version starts at."""
        major, minor = self.major_minor
        return f"{major}.{minor}"

    @property
    def version_array(self) -> list[int]:
        return [int(p) for p in self.version.split(".")] + [0]


def fcv_tuple(version: str) -> tuple[int, int]:
    """``"9.0"`` as ``(9, 0)``, to compare FCVs."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _profile(version: str, wire: int) -> VersionProfile:
    full = tuple(int(p) for p in version.split("."))
    mm = full[:2]
    return VersionProfile(
        version=version,
        max_wire_version=wire,
        token_version=2 if mm >= (6, 1) else 1,
        wall_time=mm >= (6, 0),
        v2_update_oplog=mm >= (5, 0),
        resumable_label=mm >= (4, 4),
        expanded_events=mm >= (6, 0),
        pre_post_images=mm >= (6, 0),
        disambiguated_paths=mm >= (6, 1),
        ns_type=mm >= (8, 1),
        split_events=mm >= (7, 0) or (mm == (6, 0) and full >= (6, 0, 9)),
        any_type_comment=mm >= (4, 4),
        topology_version=mm >= (4, 4),
        rejects_op_query_commands=mm >= (5, 1),
        invalidated_flag=mm >= (7, 0),
        bulk_write=mm >= (8, 0),
        retried_stmt_ids=mm >= (6, 0),
        two_phase_index_builds=mm >= (4, 4),
        quiesce_mode=mm >= (5, 0),
        reader_version=mm >= (8, 2),
        show_commit_timestamp=full >= (8, 2, 1),
        expanded_fields_by_default=full == (8, 2, 0),
        ignore_removed_shards=mm >= (9, 0),
        precise_shard_targeting=mm >= (9, 0),
        large_event_metrics=(
            mm >= (7, 0) or (mm == (6, 0) and full >= (6, 0, 7)) or (mm == (5, 0) and full >= (5, 0, 19))
        ),
        option_metrics=mm >= (9, 0),
    )


VERSIONS: dict[str, VersionProfile] = {
    "4.2": _profile("4.2.25", 8),
    "4.4": _profile("4.4.29", 9),
    "5.0": _profile("5.0.31", 13),
    "6.0": _profile("6.0.20", 17),
    "7.0": _profile("7.0.16", 21),
    "8.0": _profile("8.0.4", 25),
    "8.2": _profile("8.2.1", 27),
    "8.3": _profile("8.3.0", 28),
    "9.0": _profile("9.0.0", 29),
    "9.1": _profile("9.1.0", 30),
}
"""Emulated release lines, keyed by ``major.minor``.

Wire versions 28 (8.3) and 30 (9.1) are an assumption: mongod's ``wire_version.h`` names
``WIRE_VERSION_90`` without a value the simulator could read; one per release, as 21 (7.0)
to 25 (8.0) and 29 (9.0, per a driver's design notes), gives these (docs/testing.md)."""

DEFAULT_VERSION = "8.0"


def get_profile(version: str) -> VersionProfile:
    """The profile for a release line (``"8.0"``) or for one patch release of it (``"6.0.8"``).

    A patch release matters where a feature arrived mid-line (split events in
    6.0.9); its profile reports that exact version. Raises ValueError otherwise.
    """
    parts = version.split(".")
    key = ".".join(parts[:2])
    line = VERSIONS.get(key)
    if line is None or not all(p.isdigit() for p in parts) or len(parts) > 3:
        known = ", ".join(VERSIONS)
        raise ValueError(f"unsupported server version {version!r}; emulated: {known}")
    if len(parts) == 3 and version != line.version:
        return _profile(version, line.max_wire_version)
    return line
