"""pytest glue for the spec tests: options, the custom collector, the shared targets."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spec_tests.runner.adapter import CLIENTS
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


@pytest.fixture(scope="session")
def spec_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """A MongoDB 8.0 simulated replica set, or the ``MONGODB_URI`` deployment."""
    yield get_pool(request.config).get("8.0", "replicaset")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``spec_client_impl``: each change-stream client under test, as a parameter."""
    if "spec_client_impl" in metafunc.fixturenames:
        metafunc.parametrize("spec_client_impl", client_impls(metafunc.config))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say which CSOT cases needed another run, and why: a re-run is never silent."""
    retries = terminalreporter.config.stash.get(CSOT_RETRIES, [])
    if retries:
        terminalreporter.section(f"CSOT cases run again after a timeout: {len(retries)}")
        for line in retries:
            terminalreporter.write_line(f"  {line}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built (thousands of items): later full collections skip it.

    Without this a full collection scans ~150,000 long-lived objects (~90 ms on
    a loaded machine), long enough to break the timing of CSOT tests.
    """
    gc.collect()
    gc.freeze()
