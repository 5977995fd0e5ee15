"""Runner pieces that need no server: loading, requirements, the matrix, errors, arguments."""

from __future__ import annotations

from typing import Any

import pymongo.common
import pytest
from pymongo.errors import ExecutionTimeout, NetworkTimeout, NotPrimaryError, OperationFailure

from spec_tests.runner import RunnerError, SpecFailure, matrix
from spec_tests.runner.adapter import watch_options
from spec_tests.runner.errors import check_expected_error, describe, server_reply
from spec_tests.runner.loader import (
    SpecFile,
    discover,
    label_for,
    load_spec_file,
    missing_reason,
    parse_version,
    spec_dir,
    spec_required,
)
from spec_tests.runner.matrix import (
    CSOT_RUNS,
    Case,
    execute_case,
    grouped_by_target,
    load_files,
    run_case,
    simulator_cases,
)
from spec_tests.runner.operations import Args
from spec_tests.runner.requirements import ServerInfo, unmet, unmet_any

RS_80 = ServerInfo(version=(8, 0, 4), topology="replicaset")

_MISSING = missing_reason()
needs_spec_files = pytest.mark.skipif(
    _MISSING is not None and not spec_required(), reason=_MISSING or ""
)
"""For the tests that read the spec files themselves (the rest run on any clone)."""

# -- loader --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("4.2", (4, 2, 0)),
        ("4.2.99", (4, 2, 99)),
        ("8", (8, 0, 0)),
        ("4.9.0-alpha4-271-g7d5cf02", (4, 9, 0)),
        ("3.6.0", (3, 6, 0)),
    ],
)
def test_parse_version(text: str, parsed: tuple[int, int, int]) -> None:
    assert parse_version(text) == parsed


@needs_spec_files
def test_in_scope_files_and_test_counts() -> None:
    files, broken = load_files()
    assert broken == []
    counts: dict[str, int] = {}
    for spec in files:
        group = spec.path.relative_to(spec_dir()).parts[0:2]
        counts["/".join(group)] = counts.get("/".join(group), 0) + len(spec.tests)
    assert counts == {
        "change-streams/unified": 89,
        "related/retryable-reads": 51,
        "csot/tests": 8,
        "related/unified-test-format-valid-pass": 3,
    }


@needs_spec_files
def test_labels_are_short_and_unique() -> None:
    root = spec_dir()
    labels = [label_for(p, root) for p in discover()]
    assert len(labels) == len(set(labels))
    assert "change-streams.json" in labels
    assert "csot/change-streams.json" in labels
    assert "retryable-reads/changeStreams-client.watch.json" in labels


def test_newer_schema_versions_are_refused(tmp_path: Any) -> None:
    path = tmp_path / "future.json"
    path.write_text('{"description": "x", "schemaVersion": "1.99", "tests": []}')
    with pytest.raises(RunnerError, match=r"schemaVersion 1\.99 is not supported"):
        load_spec_file(path, tmp_path)
    path.write_text('{"description": "x", "schemaVersion": "1.4", "tests": [], "weird": 1}')
    with pytest.raises(RunnerError, match="weird"):
        load_spec_file(path, tmp_path)


# -- requirements ---------------------------------------------------------------------------


def test_version_bounds_are_inclusive() -> None:
    assert unmet({"minServerVersion": "8.0.4", "maxServerVersion": "8.0.4"}, RS_80) == []
    assert unmet({"minServerVersion": "8.1.0"}, RS_80) == ["server 8.0.4 < minServerVersion 8.1.0"]
    assert unmet({"maxServerVersion": "7.99"}, RS_80) == ["server 8.0.4 > maxServerVersion 7.99"]


def test_topologies_serverless_auth_csfle() -> None:
    assert unmet({"topologies": ["replicaset", "sharded"]}, RS_80) == []
    assert unmet({"topologies": ["single"]}, RS_80)
    sharded = ServerInfo(version=(8, 0, 0), topology="sharded")
    assert unmet({"topologies": ["sharded-replicaset"]}, sharded) == []
    assert unmet({"serverless": "forbid"}, RS_80) == []
    assert unmet({"serverless": "require"}, RS_80) == ["needs Atlas Serverless"]
    assert unmet({"auth": True}, RS_80) == ["needs authentication"]
    assert unmet({"auth": False}, RS_80) == []
    assert unmet({"csfle": True}, RS_80)
    assert unmet({"csfle": False}, RS_80) == []


def test_unknown_requirement_field_is_loud() -> None:
    with pytest.raises(RunnerError):
        unmet({"minServerVersion": "4.0", "bogus": 1}, RS_80)


def test_any_requirement_suffices() -> None:
    reqs: list[dict[str, Any]] = [{"minServerVersion": "9.0"}, {"topologies": ["replicaset"]}]
    assert unmet_any(reqs, RS_80) is None
    reason = unmet_any([{"minServerVersion": "9.0"}, {"topologies": ["single"]}], RS_80)
    assert reason is not None and "9.0" in reason and "single" in reason


def test_server_parameters_compare_flexibly_and_missing_means_unmet() -> None:
    params = {"enableTestCommands": 1.0}

    def get(name: str) -> Any:
        return params[name]

    live = ServerInfo(version=(8, 0, 0), topology="replicaset", get_parameter=get)
    assert unmet({"serverParameters": {"enableTestCommands": 1}}, live) == []
    assert unmet({"serverParameters": {"enableTestCommands": 2}}, live)
    assert unmet({"serverParameters": {"nope": True}}, live) == [
        "server parameter nope is not supported"
    ]
    assert unmet({"serverParameters": {"nope": True}}, RS_80) == []  # checked again when connected


# -- the matrix -------------------------------------------------------------------------------


def _cases_for(label: str, description: str) -> list[Any]:
    files, _ = load_files()
    spec = next(f for f in files if f.label == label)
    test = next(t for t in spec.tests if t["description"] == description)
    only = SpecFile(spec.path, spec.label, {**spec.data, "tests": [test]})
    return simulator_cases([only], ["4.2", "6.0", "8.0", "8.2"])


@needs_spec_files
def test_sharded_only_test_runs_on_the_simulated_cluster() -> None:
    cases = _cases_for(
        "change-streams-showExpandedEvents.json",
        "when showExpandedEvents is true, shardCollection events are reported",
    )
    by_topology = {c.topology for c in cases if c.skip is None}
    assert by_topology == {"sharded"}
    by_version = {c.version: c.skip for c in cases if c.topology == "sharded"}
    assert by_version["8.0"] is None
    assert by_version["4.2"] is not None and "minServerVersion 6.0.0" in by_version["4.2"]


@needs_spec_files
def test_tests_admitting_every_topology_run_on_all_three() -> None:
    files, _ = load_files()
    spec = next(f for f in files if f.label == "change-streams-resume-errorLabels.json")
    cases = simulator_cases([spec], ["8.0"])
    assert {c.topology for c in cases} == {"replicaset", "sharded", "load-balanced"}


@needs_spec_files
def test_single_topology_cases_exist_only_when_asked_for() -> None:
    cases = _cases_for(
        "change-streams-errors.json",
        "The watch helper must not throw a custom exception when executed against a single "
        "server topology, but instead depend on a server error",
    )
    assert {c.topology for c in cases} == {"replicaset", "single"}
    single_80 = next(c for c in cases if c.topology == "single" and c.version == "8.0")
    assert single_80.skip is None
    assert single_80.id.endswith("[8.0-single]")
    assert all(c.skip for c in cases if c.topology == "replicaset")


@needs_spec_files
def test_old_servers_are_skipped_when_pymongo_cannot_talk_to_them(monkeypatch: Any) -> None:
    description = "Test with string comment"
    monkeypatch.setattr(pymongo.common, "MIN_SUPPORTED_WIRE_VERSION", 9)
    cases = {c.version: c.skip for c in _cases_for("change-streams.json", description)}
    assert cases["4.2"] == (
        f"PyMongo {pymongo.version} cannot talk to MongoDB 4.2 (needs PyMongo <4.16)"
    )
    assert cases["8.0"] is None
    monkeypatch.setattr(pymongo.common, "MIN_SUPPORTED_WIRE_VERSION", 8)
    cases = {c.version: c.skip for c in _cases_for("change-streams.json", description)}
    assert cases["4.2"] is None


@needs_spec_files
def test_case_ids_are_readable() -> None:
    cases = _cases_for("change-streams.json", "Test array truncation")
    assert "change-streams.json::Test array truncation[8.0-replicaset]" in [c.id for c in cases]


def test_unknown_versions_are_refused() -> None:
    with pytest.raises(RunnerError, match="unknown versions"):
        simulator_cases([], ["9.9"])


# -- expectError --------------------------------------------------------------------------------


def _server_error(code: int, name: str, labels: list[str] | None = None) -> OperationFailure:
    details: dict[str, Any] = {"ok": 0, "code": code, "codeName": name, "errmsg": "boom"}
    if labels:
        details["errorLabels"] = labels
    return OperationFailure("boom", code, details)


def test_server_error_assertions() -> None:
    exc = _server_error(280, "ChangeStreamFatalError", ["NonResumableChangeStreamError"])
    check_expected_error(
        {
            "errorCode": 280,
            "errorCodeName": "changestreamfatalerror",
            "isClientError": False,
            "errorLabelsContain": ["NonResumableChangeStreamError"],
            "errorLabelsOmit": ["ResumableChangeStreamError"],
            "errorContains": "BOOM",
        },
        exc,
        None,  # type: ignore[arg-type]
    )
    with pytest.raises(SpecFailure, match="expected error code 281"):
        check_expected_error({"errorCode": 281}, exc, None)  # type: ignore[arg-type]
    with pytest.raises(SpecFailure, match="client-side"):
        check_expected_error({"isClientError": True}, exc, None)  # type: ignore[arg-type]
    with pytest.raises(SpecFailure, match="label ResumableChangeStreamError"):
        check_expected_error({"errorLabelsContain": ["ResumableChangeStreamError"]}, exc, None)  # type: ignore[arg-type]


def test_network_errors_are_client_errors_and_not_primary_is_a_server_error() -> None:
    check_expected_error({"isClientError": True, "isTimeoutError": True}, NetworkTimeout("t"), None)  # type: ignore[arg-type]
    not_primary = NotPrimaryError("np", {"ok": 0, "code": 10107, "codeName": "NotWritablePrimary"})
    check_expected_error({"isClientError": False, "errorCode": 10107}, not_primary, None)  # type: ignore[arg-type]


def test_server_timeouts_are_timeouts_and_server_errors() -> None:
    exc = ExecutionTimeout("slow", 50, {"ok": 0, "code": 50, "codeName": "MaxTimeMSExpired"})
    check_expected_error({"isTimeoutError": True, "isClientError": False}, exc, None)  # type: ignore[arg-type]
    with pytest.raises(SpecFailure, match="non-timeout"):
        check_expected_error({"isTimeoutError": False}, exc, None)  # type: ignore[arg-type]


def test_wrapped_server_errors_keep_their_reply() -> None:
    try:
        try:
            raise _server_error(6, "HostUnreachable")
        except OperationFailure as inner:
            raise RuntimeError("library wrapper") from inner
    except RuntimeError as outer:
        assert server_reply(outer) is not None
        check_expected_error({"errorCode": 6, "isClientError": False}, outer, None)  # type: ignore[arg-type]


def test_unknown_expect_error_keys_are_loud() -> None:
    with pytest.raises(RunnerError):
        check_expected_error({"writeErrors": {}}, ValueError("x"), None)  # type: ignore[arg-type]


def test_describe_shows_code_name_and_labels() -> None:
    text = describe(_server_error(6, "HostUnreachable", ["ResumableChangeStreamError"]))
    assert text == "OperationFailure 6 (HostUnreachable): boom ['ResumableChangeStreamError']"


# -- operation arguments --------------------------------------------------------------------------


def test_watch_options_use_pymongo_names() -> None:
    pipeline, options = watch_options(
        {
            "pipeline": [{"$match": {}}],
            "fullDocument": "updateLookup",
            "batchSize": 1,
            "showExpandedEvents": True,
            "timeoutMS": 5,
            "maxAwaitTimeMS": 1,
            "comment": "c",
        }
    )
    assert pipeline == [{"$match": {}}]
    assert options == {
        "full_document": "updateLookup",
        "batch_size": 1,
        "show_expanded_events": True,
        "timeout_ms": 5,
        "max_await_time_ms": 1,
        "comment": "c",
    }
    with pytest.raises(RunnerError, match="unsupported arguments"):
        watch_options({"pipeline": [], "hint": 1})


def test_args_refuse_leftovers_and_sessions() -> None:
    args = Args("insertOne", {"document": {}, "bogus": 1})
    args.required("document")
    with pytest.raises(RunnerError, match="bogus"):
        args.done()
    with pytest.raises(RunnerError, match="session"):
        Args("insertOne", {"session": "s0"}).done()
    with pytest.raises(RunnerError, match="missing required argument 'filter'"):
        Args("deleteOne", {}).required("filter")


class _Pool:
    def get(self, version: str, topology: str) -> None:
        return None


def _scripted(monkeypatch: pytest.MonkeyPatch, failures: list[str]) -> list[int]:
    """``run_test`` fails with each message of ``failures`` in turn, then passes."""
    calls: list[int] = []

    def run_test(*args: Any) -> None:
        calls.append(1)
        if len(calls) <= len(failures):
            raise SpecFailure(failures[len(calls) - 1])

    monkeypatch.setattr(matrix, "run_test", run_test)
    return calls


def _case(label: str) -> Case:
    return Case(label=label, description="d", version="8.0", topology="replicaset",
                spec=object(), test={})  # type: ignore[arg-type]


TIMEOUT = "operation 2 (iterateOnce on changeStream): unexpected error NetworkTimeout: timed out"
SHORT = "client client: expected 3 events, observed 2"
"""What a CSOT case printed in CI when the deadline passed before the resume's aggregate."""


def test_a_csot_case_that_failed_runs_again_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _scripted(monkeypatch, [TIMEOUT, SHORT][: CSOT_RUNS - 1])
    heard: list[int] = []
    execute_case(_case("csot/change-streams.json"), _Pool(), "changestream",  # type: ignore[arg-type]
                 on_retry=lambda run, failure: heard.append(run))
    assert len(calls) == CSOT_RUNS and heard == list(range(1, CSOT_RUNS))
    _scripted(monkeypatch, [SHORT])
    outcome = run_case(_case("csot/change-streams.json"), _Pool(), "changestream")  # type: ignore[arg-type]
    assert outcome.status == "pass" and "run 1 failed" in outcome.reason


def test_only_csot_cases_run_again_and_never_more_than_csot_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _scripted(monkeypatch, [SHORT] * CSOT_RUNS)
    with pytest.raises(SpecFailure, match="expected 3 events"):
        execute_case(_case("csot/change-streams.json"), _Pool(), "changestream")  # type: ignore[arg-type]
    assert len(calls) == CSOT_RUNS, "a failure on every run fails the test"
    calls = _scripted(monkeypatch, [TIMEOUT])
    with pytest.raises(SpecFailure):
        execute_case(_case("change-streams.json"), _Pool(), "changestream")  # type: ignore[arg-type]
    assert len(calls) == 1, "only CSOT cases are run again"


def test_cases_of_one_target_run_together_in_the_order_targets_first_appear() -> None:
    cases = [("f1", "8.0", "rs"), ("f1", "9.1", "rs"), ("f1", "8.0", "sh"),
             ("f2", "8.0", "rs"), ("f2", "9.1", "rs"), ("f2", "8.0", "sh")]
    assert grouped_by_target(cases, lambda case: (case[1], case[2])) == [
        ("f1", "8.0", "rs"), ("f2", "8.0", "rs"), ("f1", "9.1", "rs"), ("f2", "9.1", "rs"),
        ("f1", "8.0", "sh"), ("f2", "8.0", "sh")]
