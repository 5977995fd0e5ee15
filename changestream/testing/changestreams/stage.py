"""Parse and validate a change-stream pipeline the way mongod does, with its codes and messages.

The checks run in mongod's order: the "lite" parse of every stage name
(``LiteParsedPipeline``), the read concern, the ``$changeStream`` IDL parse and
``assertIsLegalSpecification``, the parse of the later stages, then the
pipeline-wide rules (stages allowed in a change stream, first/last positions).
The result, :class:`ChangeStreamSpec`, is everything the cursor needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from bson.timestamp import Timestamp

from ..core.errors import CommandError
from ..core.versions import VersionProfile
from .pipeline import Pipeline, type_name, value_to_string
from .resume_token import ResumeTokenData, decode_token, is_high_water_mark

CHANGE_STREAM: Final = "$changeStream"
SPLIT_LARGE_EVENT: Final = "$changeStreamSplitLargeEvent"

SCOPE_COLLECTION: Final = "collection"
SCOPE_DATABASE: Final = "database"
SCOPE_CLUSTER: Final = "cluster"

ALLOWED_AFTER_CHANGE_STREAM: Final = frozenset(
    {
        "$match",
        "$project",
        "$addFields",
        "$set",
        "$unset",
        "$replaceRoot",
        "$replaceWith",
        "$redact",
        SPLIT_LARGE_EVENT,
    }
)
"""Stages whose constraints say ``isAllowedInChangeStream``."""

KNOWN_STAGES: Final = frozenset(
    {
        "$addFields", "$bucket", "$bucketAuto", "$changeStream", "$collStats", "$count",
        "$currentOp", "$densify", "$documents", "$facet", "$fill", "$geoNear", "$graphLookup",
        "$group", "$indexStats", "$limit", "$listLocalSessions", "$listSessions",
        "$listSearchIndexes", "$lookup", "$match", "$merge", "$out", "$planCacheStats",
        "$project", "$redact", "$replaceRoot", "$replaceWith", "$sample", "$search",
        "$searchMeta", "$set", "$setWindowFields", "$skip", "$sort", "$sortByCount",
        "$unionWith", "$unset", "$unwind", "$vectorSearch",
    }
)  # fmt: skip
"""Stage names mongod recognises (anything else: 40324)."""

FULL_DOCUMENT_MODES: Final = ("default", "updateLookup", "whenAvailable", "required")
BEFORE_CHANGE_MODES: Final = ("off", "whenAvailable", "required")
READER_VERSIONS: Final = ("v1", "v2")
"""``$changeStream.version`` values (8.2+; ``ignoreRemovedShards`` comes with 9.0)."""
_INTERNAL_DBS: Final = ("admin", "config", "local")


@dataclass(frozen=True, slots=True)
class ChangeStreamSpec:
    """A validated ``$changeStream`` and the stages after it."""

    db: str
    coll: str | None
    """None for database and cluster streams (``{aggregate: 1}``)."""
    cluster: bool = False
    full_document: str = "default"
    full_document_before_change: str = "off"
    show_expanded_events: bool = False
    show_system_events: bool = False
    show_raw_update_description: bool = False
    resume_token: ResumeTokenData | None = None
    """From resumeAfter or startAfter."""
    resume_token_doc: dict[str, Any] | None = None
    start_after: bool = False
    start_at_operation_time: Timestamp | None = None
    token_version: int = 2
    """Version of the tokens this stream mints (for events after the resume point)."""
    pipeline: Pipeline = field(default_factory=lambda: Pipeline(()))
    split_large_events: bool = False
    reader_version: str | None = None
    """``version`` as given (``"v1"``/``"v2"``); only mongos acts on it."""
    ignore_removed_shards: bool = False
    """``ignoreRemovedShards: true`` (9.0+): a v2 stream through mongos skips removed shards."""

    @property
    def scope(self) -> str:
        if self.coll is not None:
            return SCOPE_COLLECTION
        return SCOPE_CLUSTER if self.cluster else SCOPE_DATABASE

    @property
    def ns(self) -> str:
        """The cursor's namespace: ``db.coll`` or ``db.$cmd.aggregate``."""
        return f"{self.db}.{self.coll}" if self.coll is not None else f"{self.db}.$cmd.aggregate"


# -- the lite parse ---------------------------------------------------------------------------------
def lite_parse(profile: VersionProfile, pipeline: list[Any]) -> list[tuple[str, Any]]:
    """``(stage name, spec)`` pairs; rejects malformed stages and unknown names (40323/40324)."""
    stages: list[tuple[str, Any]] = []
    for raw in pipeline:
        if not isinstance(raw, Mapping):
            raise CommandError(14, "Each element of the 'pipeline' array must be an object")
        if len(raw) != 1:
            raise CommandError(
                40323, "A pipeline stage specification object must contain exactly one field."
            )
        name, spec = next(iter(raw.items()))
        known = name in KNOWN_STAGES or (name == SPLIT_LARGE_EVENT and profile.split_events)
        if not known:
            raise CommandError(40324, f"Unrecognized pipeline stage name: '{name}'")
        if name == CHANGE_STREAM and profile.expanded_events and not isinstance(spec, Mapping):
            raise CommandError(
                6188500,
                f"$changeStream must take a nested object but found: $changeStream: "
                f"{value_to_string(spec)}",
            )
        stages.append((name, spec))
    return stages


def check_read_concern(profile: VersionProfile, read_concern: Any) -> None:
    """Change streams only run at read concern "majority" (or unspecified)."""
    if not isinstance(read_concern, Mapping):
        return
    level = read_concern.get("level")
    if level is None or level == "majority":
        return
    if profile.major_minor < (5, 0):
        raise CommandError(
            72,
            f"Read concern {{ level: {value_to_string(level)} }} is not supported for change "
            'streams. Only read concern level "majority" is supported.',
        )
    raise CommandError(
        72,
        "Aggregation stage $changeStream cannot run with a readConcern other than 'majority'. "
        f"Current readConcern: {level}",
    )


# -- the $changeStream stage ------------------------------------------------------------------------
def _wrong_type(name: str, value: Any, expected: str) -> CommandError:
    return CommandError(
        14,
        f"BSON field '$changeStream.{name}' is the wrong type '{type_name(value)}', "
        f"expected type '{expected}'",
    )


def _bad_enum(name: str, value: str) -> CommandError:
    return CommandError(
        2, f"Enumeration value '{value}' for field '$changeStream.{name}' is not a valid value."
    )


class _SpecParser:
    """The IDL parse of ``DocumentSourceChangeStreamSpec`` for one emulated version."""

    def __init__(self, profile: VersionProfile) -> None:
        self.profile = profile
        bool_fields = {"allChangesForCluster", "showMigrationEvents", "allowToRunOnConfigDB"}
        if profile.show_commit_timestamp:
            bool_fields.add("showCommitTimestamp")  # internal; only prepared transactions use it
        if profile.ignore_removed_shards:
            bool_fields.add("ignoreRemovedShards")
        if profile.expanded_events:
            bool_fields |= {
                "showExpandedEvents",
                "showSystemEvents",
                "allowToRunOnSystemNS",
                "showRawUpdateDescription",
            }
        self.bool_fields = frozenset(bool_fields)
        self.values: dict[str, Any] = {}

    def parse(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        for name, value in spec.items():
            self.values[name] = self._field(name, value)
        return self.values

    def _field(self, name: str, value: Any) -> Any:
        if name in ("resumeAfter", "startAfter"):
            if not isinstance(value, Mapping):
                raise _wrong_type(name, value, "object")
            return dict(value)
        if name == "startAtOperationTime":
            if not isinstance(value, Timestamp):
                raise _wrong_type(name, value, "timestamp")
            return value
        if name == "fullDocument":
            if not isinstance(value, str):
                raise _wrong_type(name, value, "string")
            if self.profile.pre_post_images and value not in FULL_DOCUMENT_MODES:
                raise _bad_enum(name, value)
            return value
        if name == "fullDocumentBeforeChange" and self.profile.pre_post_images:
            if not isinstance(value, str):
                raise _wrong_type(name, value, "string")
            if value not in BEFORE_CHANGE_MODES:
                raise _bad_enum(name, value)
            return value
        if name == "version" and self.profile.reader_version:
            # 8.2+: the reader version, an IDL enum (SERVER-104755); a mongod (replica set or
            # shard) always reads v1, mongos decides (sharding/merge.py).
            if not isinstance(value, str):
                raise _wrong_type(name, value, "string")
            if value not in READER_VERSIONS:
                raise _bad_enum(name, value)
            return value
        if name in self.bool_fields:
            if not isinstance(value, bool):
                raise _wrong_type(name, value, "bool")
            return value
        raise CommandError(40415, f"BSON field '$changeStream.{name}' is an unknown field.")


def _check_namespace(db: str, coll: str | None, options: Mapping[str, Any]) -> None:
    """``assertIsLegalSpecification``'s namespace rules (72/73)."""
    all_changes = bool(options.get("allChangesForCluster"))
    ns = f"{db}.{coll}" if coll is not None else f"{db}.$cmd.aggregate"
    if all_changes and not (db == "admin" and coll is None):
        raise CommandError(
            72,
            "A $changeStream with 'allChangesForCluster:true' may only be opened on the 'admin' "
            f"database, and with no collection name; found {ns}",
        )
    if db == "admin":
        allowed = all_changes
    else:
        allowed = db != "local" and (db != "config" or bool(options.get("allowToRunOnConfigDB")))
    if not allowed:
        raise CommandError(73, f"$changeStream may not be opened on the internal {db} database")
    if coll is not None and coll.startswith("system.") and not options.get("allowToRunOnSystemNS"):
        raise CommandError(73, f"$changeStream may not be opened on the internal {ns} collection")


def _resolve_token(
    options: Mapping[str, Any], coll: str | None
) -> tuple[ResumeTokenData | None, dict[str, Any] | None]:
    if "resumeAfter" in options and "startAfter" in options:
        raise CommandError(
            50865, "Do not specify both 'resumeAfter' and 'startAfter' in a $changeStream stage"
        )
    token_doc = options.get("resumeAfter", options.get("startAfter"))
    token = decode_token(token_doc) if token_doc is not None else None
    if token is not None and "startAtOperationTime" in options:
        raise CommandError(
            40674, "Only one type of resume option is allowed, but multiple were found"
        )
    if token is not None and "resumeAfter" in options and token.from_invalidate:
        raise CommandError(
            260,
            "Attempting to resume a change stream using 'resumeAfter' is not allowed from an "
            "invalidate notification",
        )
    if (
        token is not None
        and token.uuid is None
        and coll is not None
        and not is_high_water_mark(token)
    ):
        raise CommandError(
            260,
            "Attempted to resume a single-collection stream, but the resume token does not "
            "include a UUID",
        )
    return token, token_doc


def default_token_version(
    profile: VersionProfile, generate_v2_tokens: bool | None, *, split: bool = False
) -> int:
    """The token version a new stream mints (``$_generateV2ResumeTokens`` overrides, 6.0+).

    A split stage needs v2 tokens (only they carry ``fragmentNum``), so on 6.0,
    whose default is v1, a pipeline with ``$changeStreamSplitLargeEvent``
    mints v2 tokens (SERVER-81295: "generate V2 resume tokens by design").
    """
    if generate_v2_tokens is None or not profile.expanded_events:
        return 2 if split else profile.token_version
    return 2 if generate_v2_tokens else 1


def parse_change_stream(
    profile: VersionProfile,
    stages: list[tuple[str, Any]],
    *,
    db: str,
    coll: str | None,
    standalone: bool,
    generate_v2_tokens: bool | None = None,
) -> ChangeStreamSpec:
    """Validate a lite-parsed pipeline that contains ``$changeStream``; build its spec."""
    spec_index = next(i for i, (name, _) in enumerate(stages) if name == CHANGE_STREAM)
    raw_spec = stages[spec_index][1]
    if not isinstance(raw_spec, Mapping):
        raise CommandError(50808, "$changeStream stage expects a document as argument")
    options = _SpecParser(profile).parse(raw_spec)
    if standalone:
        raise CommandError(40573, "The $changeStream stage is only supported on replica sets")
    _check_namespace(db, coll, options)
    token, token_doc = _resolve_token(options, coll)
    full_document = options.get("fullDocument", "default")
    if full_document not in FULL_DOCUMENT_MODES[:2] and not profile.pre_post_images:
        raise CommandError(
            40575,
            "unrecognized value for the 'fullDocument' option to the $changeStream stage. "
            f'Expected "default" or "updateLookup", got "{full_document}"',
        )
    user_stages = stages[spec_index + 1 :]
    for name, spec in user_stages:
        if name == SPLIT_LARGE_EVENT and spec != {}:
            raise CommandError(
                7182800, "$changeStreamSplitLargeEvent spec should be an empty object"
            )
    pipeline = Pipeline(
        {name: spec}
        for name, spec in user_stages
        if name in ALLOWED_AFTER_CHANGE_STREAM and name not in (SPLIT_LARGE_EVENT, CHANGE_STREAM)
    )
    _check_positions(stages, spec_index)
    split = any(name == SPLIT_LARGE_EVENT for name, _ in user_stages)
    if token is not None and token.fragment_num is not None and not split:
        raise CommandError(
            280,
            "To resume from a split event, the $changeStream pipeline must include a "
            "$changeStreamSplitLargeEvent stage",
        )
    return ChangeStreamSpec(
        db=db,
        coll=coll,
        cluster=bool(options.get("allChangesForCluster")),
        full_document=full_document,
        full_document_before_change=options.get("fullDocumentBeforeChange", "off"),
        show_expanded_events=bool(options.get("showExpandedEvents")),
        show_system_events=bool(options.get("showSystemEvents")),
        show_raw_update_description=bool(options.get("showRawUpdateDescription")),
        resume_token=token,
        resume_token_doc=token_doc,
        start_after="startAfter" in options,
        start_at_operation_time=options.get("startAtOperationTime"),
        token_version=default_token_version(profile, generate_v2_tokens, split=split),
        pipeline=pipeline,
        split_large_events=split,
        reader_version=options.get("version"),
        ignore_removed_shards=bool(options.get("ignoreRemovedShards")),
    )


def _check_positions(stages: list[tuple[str, Any]], spec_index: int) -> None:
    """``validateTopLevelPipeline`` and ``validateCommon`` for a change-stream pipeline."""
    is_change_stream = spec_index == 0
    for name, _ in stages:
        if is_change_stream and name not in ALLOWED_AFTER_CHANGE_STREAM and name != CHANGE_STREAM:
            raise CommandError(20, f"{name} is not permitted in a $changeStream pipeline")
        if name == SPLIT_LARGE_EVENT and not is_change_stream:
            raise CommandError(20, f"{name} can only be used in a $changeStream pipeline")
    seen_split = False
    for index, (name, _) in enumerate(stages):
        if name == CHANGE_STREAM and index != 0:
            raise CommandError(40602, f"{name} is only valid as the first stage in a pipeline")
        if name == SPLIT_LARGE_EVENT:
            if index != len(stages) - 1:
                raise CommandError(7182802, f"{name} must be the last stage in the pipeline")
            if seen_split:
                raise CommandError(7183900, f"{name} can only be used once in the pipeline")
            seen_split = True


def check_plain_pipeline(stages: list[tuple[str, Any]]) -> None:
    """The change-stream-only stage outside a change stream (20)."""
    for name, _ in stages:
        if name == SPLIT_LARGE_EVENT:
            raise CommandError(20, f"{name} can only be used in a $changeStream pipeline")
