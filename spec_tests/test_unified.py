"""pytest entry for the unified spec tests: one item per (file, test, version, topology, client).

``conftest.py`` hands this module to :class:`UnifiedModule`, which collects
one :class:`SpecFileCollector` per spec file and one :class:`SpecItem` per
matrix case and client mode, so ids read like
``test_unified.py::change-streams.json::Test array truncation[8.0-replicaset]``
(``changestream``) and ``...[8.0-replicaset-async]`` (``changestream-async``).
By default every case runs in both of those modes; ``--spec-client``
(SPEC_TESTS_CLIENT) picks one client instead. Other options (or environment
variables): ``--spec-versions`` (SPEC_TESTS_VERSIONS), ``--spec-files``
(SPEC_TESTS_FILES).

In the default matrix (no ``--spec-client``, no ``--spec-versions``) the async client's
cases on the versions outside ``ASYNC_DEFAULT_VERSIONS`` are marked ``slow``: the default
suite runs ``changestream`` on every version and ``changestream-async`` on those four, and
``pytest -m slow`` (CI's slow leg) runs the rest. The async client is generated from the
same source as the sync one (``tools/gen_sync.py``) and every version-dependent decision
is in the shared state machine, so what the async cases add on one more version is the
same ``await`` path again; see ``ASYNC_DEFAULT_VERSIONS``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import pytest

from spec_tests.runner import RunnerError, SpecFailure, SpecSkip
from spec_tests.runner.adapter import ASYNC_CLIENT, CLIENTS, DEFAULT_CLIENTS
from spec_tests.runner.gc_pauses import no_gc_pauses
from spec_tests.runner.loader import missing_reason, spec_required
from spec_tests.runner.matrix import Case, build_cases, execute_case
from spec_tests.runner.targets import TargetPool

ASYNC_DEFAULT_VERSIONS = frozenset({"4.4", "6.0", "8.0", "9.1"})
"""Versions on which the default suite runs the async client too: the oldest the current
PyMongo talks to (4.2 is skipped at run time there), the first with expanded events and
pre- and post-images, the simulator's default, and the newest. Its cases on the other
versions are ``slow`` (CI's slow leg runs them)."""

_POOL = pytest.StashKey[TargetPool]()
CSOT_RETRIES = pytest.StashKey[list[str]]()
"""CSOT cases run again after a failed run (see ``runner.matrix.CSOT_RUNS``), listed at the end."""


def option(config: pytest.Config, name: str, env: str, default: str | None = None) -> str | None:
    """A ``--spec-*`` option, falling back to its environment variable."""
    value = config.getoption(name, default=None)
    return value if value is not None else os.environ.get(env, default)


def get_pool(config: pytest.Config) -> TargetPool:
    """The session's targets (simulators started on first use, stopped at exit)."""
    if _POOL not in config.stash:
        pool = TargetPool(os.environ.get("MONGODB_URI"))
        config.stash[_POOL] = pool
        config.add_cleanup(pool.close)
    return config.stash[_POOL]


def client_impls(config: pytest.Config) -> tuple[str, ...]:
    """The change-stream clients under test: the one asked for, else both of ours."""
    chosen = option(config, "--spec-client", "SPEC_TESTS_CLIENT")
    return (chosen,) if chosen else DEFAULT_CLIENTS


class UnifiedModule(pytest.Module):
    """This module, collected as spec files instead of Python test functions."""

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        config = self.config
        missing = missing_reason()
        if missing is not None:
            if spec_required():
                raise self.CollectError(f"{missing} (SPEC_TESTS_REQUIRED is set)")
            pytest.skip(missing, allow_module_level=True)
        versions = option(config, "--spec-versions", "SPEC_TESTS_VERSIONS")
        pattern = option(config, "--spec-files", "SPEC_TESTS_FILES")
        try:
            cases = build_cases(
                get_pool(config),
                [v.strip() for v in versions.split(",")] if versions else None,
                pattern,
            )
        except RunnerError as exc:
            raise self.CollectError(f"cannot build the spec test matrix: {exc}") from exc
        clients = client_impls(config)
        if set(clients) - set(CLIENTS):
            raise self.CollectError(
                f"SPEC_TESTS_CLIENT must be one of {', '.join(CLIENTS)}, not {clients[0]!r}"
            )
        by_file: dict[str, list[Case]] = {}
        for case in cases:
            by_file.setdefault(case.label, []).append(case)
        full_matrix = not versions and clients == DEFAULT_CLIENTS
        for label, file_cases in by_file.items():
            yield SpecFileCollector.from_parent(
                self, name=label, cases=file_cases, clients=clients, full_matrix=full_matrix
            )


def is_slow(case: Case, client: str, full_matrix: bool) -> bool:
    """Whether a case of the default (full) matrix runs in the slow leg only: the async
    client's outside ``ASYNC_DEFAULT_VERSIONS``. A matrix narrowed by ``--spec-client`` or
    ``--spec-versions`` runs whole, as asked."""
    return full_matrix and client == ASYNC_CLIENT and case.version not in ASYNC_DEFAULT_VERSIONS


class SpecFileCollector(pytest.Collector):
    """The cases of one spec file, once per client mode (all of one mode first)."""

    def __init__(
        self, *, cases: list[Case], clients: tuple[str, ...], full_matrix: bool, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.cases = cases
        self.clients = clients
        self.full_matrix = full_matrix

    def collect(self) -> Iterable[pytest.Item]:
        for client in self.clients:
            for case in self.cases:
                item = SpecItem.from_parent(
                    self, name=case.name_for(client), case=case, client=client
                )
                if case.skip is not None:
                    item.add_marker(pytest.mark.skip(reason=case.skip))
                if is_slow(case, client, self.full_matrix):
                    item.add_marker(pytest.mark.slow)
                yield item


class SpecItem(pytest.Item):
    """One (file, test, version, topology) case run with one change-stream client."""

    def __init__(self, *, case: Case, client: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.case = case
        self.client = client

    def runtest(self) -> None:
        def on_retry(run: int, failure: SpecFailure) -> None:
            first_line = str(failure).strip().splitlines()[-1]
            self.config.stash.setdefault(CSOT_RETRIES, []).append(
                f"{self.case.id_for(self.client)}: run {run} failed ({first_line})")

        with no_gc_pauses():
            try:
                execute_case(self.case, get_pool(self.config), self.client, on_retry)
            except SpecSkip as exc:
                pytest.skip(str(exc))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, (SpecFailure, RunnerError)):
            kind = "runner" if isinstance(excinfo.value, RunnerError) else "failed"
            return f"{self.case.id_for(self.client)} {kind}:\n{excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int, str]:
        return self.path, 0, self.case.id_for(self.client)
