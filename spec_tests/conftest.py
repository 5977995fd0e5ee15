"""pytest glue for the spec tests: options, the custom collector, the shared targets."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from spec_tests.runner.adapter import CLIENTS
from spec_tests.runner.matrix import Case, grouped_by_target
from spec_tests.runner.targets import Target
from spec_tests.test_unified import CSOT_RETRIES, UnifiedModule, client_impls, get_pool


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("spec tests", "unified spec test runner")
    group.addoption(
        "--spec-client",
        choices=CLIENTS,
        help="change-stream client under test (env SPEC_TESTS_CLIENT; "
        "default: changestream and changestream-async, each case once per client)",
    )
    group.addoption(
        "--spec-versions",
        help="comma-separated emulated versions (env SPEC_TESTS_VERSIONS; default all)",
    )
    group.addoption("--spec-files", help="glob of spec files to run (env SPEC_TESTS_FILES)")


def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> pytest.Module | None:
    if module_path.name == "test_unified.py":
        return UnifiedModule.from_parent(parent, path=module_path)
    return None


SPEC_TARGET = ("8.0", "replicaset")
"""The (version, topology) of the ``spec_target`` fixture."""


@pytest.fixture
def spec_target(request: pytest.FixtureRequest) -> Target:
    """A MongoDB 8.0 simulated replica set, or the ``MONGODB_URI`` deployment.

    Per test: the pool may have stopped the simulator since the previous one
    (it keeps only a few running), and then starts it again."""
    return get_pool(request.config).get(*SPEC_TARGET)


def target_of(item: pytest.Item) -> tuple[str, str] | None:
    """The (version, topology) an item runs against, when it uses the pool."""
    case = getattr(item, "case", None)
    if case is None:
        callspec = getattr(item, "callspec", None)
        case = callspec.params.get("case") if callspec is not None else None
    if isinstance(case, Case):
        return case.version, case.topology
    if "spec_target" in getattr(item, "fixturenames", ()):
        return SPEC_TARGET
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within each module, run the items of one target together.

    The pool keeps only a few simulators running (``MAX_LIVE_SIMULATORS``: idle ones
    cost the timing tests their slack), so a module whose items visit every target
    in turn, as the unified suite's do (test by test, version by version), would
    start each simulator again and again. Grouped, each starts once per module.
    Items keep their order within a target and modules keep theirs.
    """
    by_module: dict[pytest.Module | None, list[tuple[int, tuple[str, str]]]] = {}
    for index, item in enumerate(items):
        target = target_of(item)
        if target is not None:
            by_module.setdefault(item.getparent(pytest.Module), []).append((index, target))
    for slots in by_module.values():
        moved = [items[index] for index, _ in grouped_by_target(slots, lambda slot: slot[1])]
        for (index, _), item in zip(slots, moved, strict=True):
            items[index] = item


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``spec_client_impl``: each change-stream client under test, as a parameter."""
    if "spec_client_impl" in metafunc.fixturenames:
        metafunc.parametrize("spec_client_impl", client_impls(metafunc.config))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say which CSOT cases needed another run, and why: a re-run is never silent."""
    retries = terminalreporter.config.stash.get(CSOT_RETRIES, [])
    if retries:
        terminalreporter.section(f"CSOT cases run again after a failed run: {len(retries)}")
        for line in retries:
            terminalreporter.write_line(f"  {line}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built (thousands of items): later full collections skip it.

    Without this a full collection scans ~150,000 long-lived objects (~90 ms on
    a loaded machine), long enough to break the timing of CSOT tests.
    """
    gc.collect()
    gc.freeze()
