"""Diagnostic commands drivers and test harnesses call: explain, validate, profile, replSetFreeze.

The simulator has no query planner, storage engine or profiler, so each answers with
the shape mongod gives and the facts it knows (documents examined and returned, record
and index counts), and refuses what it cannot do rather than pretending:

* ``explain`` runs the explained ``find``/``count``/``distinct``/``aggregate``/
  ``update``/``delete``/``findAndModify`` checks (a bad filter fails as the command
  would) and reports one ``COLLSCAN`` plan with ``executionStats`` (mongod's
  ``explain`` command, ``src/mongo/db/commands/explain_cmd.cpp``; output format in
  the manual's "Explain Results").
* ``validate`` reports a valid collection (``src/mongo/db/commands/validate.cpp``):
  NamespaceNotFound (26) for a missing one, as mongod.
* ``profile`` reads and sets level 0 (``-1`` reads); levels 1 and 2 are refused: the
  simulator writes no ``system.profile``.
* ``replSetFreeze`` (``repl_set_commands.cpp``): a secondary accepts it and answers as
  mongod does; elections are instant here, so the freeze has no effect; a primary fails
  with NotSecondary (95), as mongod.
"""

from __future__ import annotations

from typing import Any

from ..core.context import CommandContext
from ..core.errors import CommandError
from ..storage import type_name
from .reads import hinted_key, read_documents
from .spec import command

_EXPLAINABLE = frozenset(
    {"find", "count", "distinct", "aggregate", "update", "delete", "findAndModify"}
)
_VERBOSITIES = ("queryPlanner", "executionStats", "allPlansExecution")


def _explained_filter(name: str, inner: dict[str, Any]) -> dict[str, Any]:
    if name == "find":
        value = inner.get("filter")
    elif name in ("count", "distinct", "findAndModify"):
        value = inner.get("query")
    elif name == "aggregate":
        pipeline = inner.get("pipeline") or []
        first = pipeline[0] if pipeline and isinstance(pipeline[0], dict) else {}
        value = first.get("$match")
    else:
        field = "updates" if name == "update" else "deletes"
        statements = inner.get(field) or [{}]
        value = statements[0].get("q") if isinstance(statements[0], dict) else None
    return value if isinstance(value, dict) else {}


@command("explain")
def explain(ctx: CommandContext) -> dict[str, Any]:
    inner = ctx.target
    if not isinstance(inner, dict) or not inner:
        raise CommandError(
            14,
            f"BSON field 'explain.explain' is the wrong type '{type_name(inner)}', expected type "
            "'object'",
        )
    verbosity = ctx.body.get("verbosity", "allPlansExecution")
    if verbosity not in _VERBOSITIES:
        raise CommandError(
            2,
            f"Enumeration value '{verbosity}' for field 'explain.verbosity' is not a valid value.",
        )
    name = next(iter(inner))
    if name not in _EXPLAINABLE:
        raise CommandError(
            59, f"Explain failed due to unknown command: {name}", code_name="CommandNotFound"
        )
    coll = inner[name]
    if not isinstance(coll, str):
        raise CommandError(73, f"collection name has invalid type {type_name(coll)}")
    query = _explained_filter(name, inner)
    found = read_documents(ctx, coll, query)
    state = ctx.deployment.catalog.get(ctx.db, coll)
    hinted_key(state, inner.get("hint"))  # a hint naming no index fails as the command would
    examined = len(state) if state is not None else 0
    limit = inner.get("limit")
    returned = min(len(found), int(limit)) if isinstance(limit, int) and limit > 0 else len(found)
    ns = f"{ctx.db}.{coll}"
    plan = (
        {"stage": "COLLSCAN", "filter": query, "direction": "forward"}
        if state
        else {"stage": "EOF"}
    )
    reply: dict[str, Any] = {
        "explainVersion": "1",
        "queryPlanner": {
            "namespace": ns,
            "parsedQuery": query,
            "indexFilterSet": False,
            "planCacheShapeHash": "00000000",
            "maxIndexedOrSolutionsReached": False,
            "maxIndexedAndSolutionsReached": False,
            "maxScansToExplodeReached": False,
            "prunedSimilarIndexes": False,
            "winningPlan": plan,
            "rejectedPlans": [],
        },
    }
    if verbosity != "queryPlanner":
        reply["executionStats"] = {
            "executionSuccess": True,
            "nReturned": returned,
            "executionTimeMillis": 0,
            "totalKeysExamined": 0,
            "totalDocsExamined": examined,
            "executionStages": {**plan, "nReturned": returned, "docsExamined": examined},
        }
        if verbosity == "allPlansExecution":
            reply["executionStats"]["allPlansExecution"] = []
    reply["command"] = {**inner, "$db": ctx.db}
    reply["serverInfo"] = {
        "host": ctx.member.host,
        "port": ctx.member.port,
        "version": ctx.deployment.profile.version,
    }
    return reply


@command("validate")
def validate(ctx: CommandContext) -> dict[str, Any]:
    coll = ctx.target
    if not isinstance(coll, str):
        raise CommandError(73, f"collection name has invalid type {type_name(coll)}")
    ns = f"{ctx.db}.{coll}"
    state = ctx.deployment.catalog.get(ctx.db, coll)
    if state is None or state.is_view:
        raise CommandError(26, f"Collection '{ns}' does not exist to validate.")
    n = len(state)
    names = [spec["name"] for spec in state.indexes]
    return {
        "ns": ns,
        "uuid": state.uuid,
        "nInvalidDocuments": 0,
        "nNonCompliantDocuments": 0,
        "nrecords": n,
        "nIndexes": len(names),
        "keysPerIndex": dict.fromkeys(names, n),
        "indexDetails": {name: {"valid": True} for name in names},
        "valid": True,
        "repaired": False,
        "warnings": [],
        "errors": [],
        "extraIndexEntries": [],
        "missingIndexEntries": [],
        "corruptRecords": [],
    }


@command("profile")
def profile(ctx: CommandContext) -> dict[str, Any]:
    level = ctx.target
    if isinstance(level, bool) or not isinstance(level, (int, float)) or level not in (-1, 0, 1, 2):
        raise CommandError(2, f"Invalid profiling level: {level}")
    if level in (1, 2):
        raise CommandError(
            2,
            f"profiling level {int(level)} is not supported by the simulator: it writes no "
            "system.profile (levels 0 and -1 work)",
        )
    return {"was": 0, "slowms": 100, "sampleRate": 1.0}


@command("replSetFreeze", admin_only=True, any_member=True, standalone_ok=False)
def repl_set_freeze(ctx: CommandContext) -> dict[str, Any]:
    secs = ctx.target
    if isinstance(secs, bool) or not isinstance(secs, (int, float)):
        raise CommandError(14, "replSetFreeze: the argument must be a number of seconds")
    if ctx.member.is_primary:
        # TopologyCoordinator::prepareFreezeResponse (topology_coordinator.cpp)
        raise CommandError(
            95,
            "Cannot freeze node when primary or running for election, state: Primary",
            code_name="NotSecondary",
        )
    if not secs:
        return {"info": "unfreezing"}
    return {}
