"""The simulator judged by a client this project did not write: PyMongo's own ``watch()``.

Every change-streams unified spec file (every event type and scope, the
resume scenarios behind each failpoint, pre/post images, expanded events)
runs with PyMongo's ``Collection.watch()`` as the client against the oldest
and the newest emulated versions. A simulator tuned to our own client would
pass ``test_unified.py`` and fail here. (The CSOT file is left out: PyMongo
itself does not reject ``maxAwaitTimeMS >= timeoutMS``.)
"""

from __future__ import annotations

import pytest

from spec_tests.runner import SpecSkip
from spec_tests.runner.loader import missing_reason, spec_required
from spec_tests.runner.matrix import Case, build_cases, execute_case
from spec_tests.test_unified import get_pool

VERSIONS = ["4.2", "4.4", "8.2"]
"""4.2 runs only where PyMongo still talks to it (the oldest-PyMongo environment)."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        missing = missing_reason()
        if missing is not None and not spec_required():
            metafunc.parametrize(
                "case", [pytest.param(None, marks=pytest.mark.skip(reason=missing))]
            )
            return
        cases = build_cases(get_pool(metafunc.config), VERSIONS, "change-streams/unified/*.json")
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def test_pymongo_watch_passes_the_change_stream_spec_against_the_simulator(
    request: pytest.FixtureRequest, case: Case
) -> None:
    try:
        execute_case(case, get_pool(request.config), "pymongo")
    except SpecSkip as exc:
        pytest.skip(str(exc))
