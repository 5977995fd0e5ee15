"""Which test runs where: one :class:`Case` per (file, test, version, topology).

Against the simulator every test gets a case for every emulated version
(replica set; standalone too when a requirement names ``single``). Cases the
requirements do not admit, or that the installed PyMongo cannot run, carry a
skip reason. Tests that admit sharded or load-balanced clusters also run on a
simulated ShardedCluster (2 shards, 2 mongoses; behind a load balancer). With ``MONGODB_URI`` each test gets one case for
the detected deployment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from . import RunnerError, SpecFailure, SpecSkip
from .adapter import DEFAULT_CLIENT, id_suffix
from .executor import run_test
from .loader import SpecFile, discover, load_spec_file, parse_version, spec_dir
from .requirements import ServerInfo, unmet_any
from .targets import TargetPool, pymongo_version_gap

CLUSTER_TOPOLOGIES = ("sharded", "load-balanced")
"""Topologies the simulator runs as a ShardedCluster (2 shards, 2 mongoses; with a load balancer)."""


@dataclass(frozen=True)
class Case:
    """One row of the matrix."""

    label: str
    """The file's short name (``change-streams.json``)."""
    description: str
    version: str
    topology: str
    spec: SpecFile | None = None
    test: dict[str, Any] | None = None
    skip: str | None = None
    error: str | None = None
    """Set when the file itself cannot be used (the case then fails)."""

    @property
    def name(self) -> str:
        return self.name_for(DEFAULT_CLIENT)

    @property
    def id(self) -> str:
        return self.id_for(DEFAULT_CLIENT)

    def name_for(self, client: str) -> str:
        """``description[8.0-replicaset]``, with the client mode's suffix (``-async``)."""
        return f"{self.description}[{self.version}-{self.topology}{id_suffix(client)}]"

    def id_for(self, client: str) -> str:
        return f"{self.label}::{self.name_for(client)}"


@dataclass(frozen=True)
class Outcome:
    status: str
    """``pass``, ``fail`` or ``skip``."""
    reason: str = ""


def emulated_versions() -> dict[str, Any]:
    """``changestream.testing.VERSIONS`` (version key -> profile)."""
    from changestream.testing import VERSIONS

    return dict(VERSIONS)


def _static_info(profile: Any, topology: str) -> ServerInfo:
    return ServerInfo(version=parse_version(profile.version), topology=topology)


def _admits(spec: SpecFile, test: dict[str, Any], info: ServerInfo) -> str | None:
    return unmet_any(spec.run_on, info) or unmet_any(test.get("runOnRequirements"), info)


def _named_topologies(spec: SpecFile, test: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for req in (spec.run_on or []) + list(test.get("runOnRequirements") or []):
        names.update(req.get("topologies") or [])
    return names


def _topologies(spec: SpecFile, test: dict[str, Any], profiles: list[Any]) -> list[str]:
    """replicaset (and single when named), plus each cluster topology the test admits."""
    named = _named_topologies(spec, test)
    candidates = ["replicaset"] + (["single"] if "single" in named else [])
    for other in CLUSTER_TOPOLOGIES:
        if any(_admits(spec, test, _static_info(p, other)) is None for p in profiles):
            candidates.append(other)
    return candidates


def simulator_cases(files: list[SpecFile], versions: list[str]) -> list[Case]:
    """The matrix against the simulator's emulated versions."""
    profiles = emulated_versions()
    unknown = [v for v in versions if v not in profiles]
    if unknown:
        raise RunnerError(f"unknown versions {unknown}; emulated: {', '.join(profiles)}")
    chosen = [profiles[v] for v in versions]
    cases = []
    for spec in files:
        for test in spec.tests:
            for topology in _topologies(spec, test, list(profiles.values())):
                for key, profile in zip(versions, chosen, strict=True):
                    skip = _admits(spec, test, _static_info(profile, topology))
                    if skip is None:
                        skip = pymongo_version_gap(key, profile.max_wire_version)
                    cases.append(
                        Case(spec.label, test["description"], key, topology, spec, test, skip)
                    )
    return cases


def real_cases(files: list[SpecFile], info: ServerInfo) -> list[Case]:
    """The matrix against the ``MONGODB_URI`` deployment (one case per test)."""
    offline = ServerInfo(version=info.version, topology=info.topology, auth=info.auth)
    return [
        Case(
            spec.label,
            test["description"],
            info.version_text,
            info.topology,
            spec,
            test,
            _admits(spec, test, offline),
        )
        for spec in files
        for test in spec.tests
    ]


def load_files(
    pattern: str | None = None, root: Path | None = None
) -> tuple[list[SpecFile], list[Case]]:
    """Parse the in-scope files; unusable files become one failing case each."""
    base = root or spec_dir()
    files, broken = [], []
    for path in discover(pattern, base):
        try:
            files.append(load_spec_file(path, base))
        except RunnerError as exc:
            broken.append(Case(path.name, "(load)", "-", "-", error=str(exc)))
    return files, broken


def build_cases(
    pool: TargetPool, versions: list[str] | None = None, pattern: str | None = None
) -> list[Case]:
    """Every case for the pool's deployment(s)."""
    files, broken = load_files(pattern)
    if pool.real_uri is not None:
        return broken + real_cases(files, pool.real().info)
    return broken + simulator_cases(files, versions or list(emulated_versions()))


_V = TypeVar("_V")


def grouped_by_target(values: Sequence[_V], target: Callable[[_V], tuple[str, str]]) -> list[_V]:
    """``values`` with those of one (version, topology) together, in the order each target
    first appears, each keeping its order: the pool keeps only a few simulators running
    (``targets.MAX_LIVE_SIMULATORS``), so each should start once, not once per test."""
    first_seen: dict[tuple[str, str], int] = {}
    for value in values:
        first_seen.setdefault(target(value), len(first_seen))
    return sorted(values, key=lambda value: first_seen[target(value)])


CSOT_RUNS = 3
"""How many times a CSOT test may run before its failure counts.

The CSOT spec tests leave 20-50 ms between what the server is made to take
(``blockTimeMS``, plus mongod's 1 s default await on a change stream's getMore)
and ``timeoutMS``. On a 2-core machine that other processes keep busy, the
scheduler alone can eat that, and the run fails in whichever way the lost time
shows: the client times out where it should not have (``NetworkTimeout``); it
refuses to send a command because the time left is below its round-trip time
(``ExecutionTimeout``, "operation would exceed time limit"); or the deadline
passes before a resume, so a command the test expects is never sent ("expected
3 events, observed 2"). All three were seen in one CI run. PyMongo's own unified
runner runs every CSOT test up to three times, whatever the failure (PYTHON-3522,
``flaky(max_runs=3)``); so does this one, and it says so (:func:`execute_case`'s
``on_retry``; pytest lists every re-run in its summary). A behaviour that is wrong
fails every run, so it still fails the test.
"""


def _runs_again(case: Case) -> bool:
    """A CSOT test: its failure may be the machine's timing (see :data:`CSOT_RUNS`)."""
    return case.label.startswith("csot/")


def execute_case(
    case: Case, pool: TargetPool, client_impl: str,
    on_retry: Callable[[int, SpecFailure], None] | None = None,
) -> None:
    """Run one case; raise SpecSkip, SpecFailure or RunnerError unless it passes.

    A CSOT case that failed runs again, up to :data:`CSOT_RUNS` times in all;
    ``on_retry(run, failure)`` hears of each failed run before the next.
    """
    if case.error is not None:
        raise RunnerError(case.error)
    if case.skip is not None:
        raise SpecSkip(case.skip)
    assert case.spec is not None and case.test is not None
    for run in range(1, CSOT_RUNS + 1):
        try:
            run_test(pool.get(case.version, case.topology), case.spec, case.test, client_impl)
            return
        except SpecFailure as failure:
            if run == CSOT_RUNS or not _runs_again(case):
                raise
            if on_retry is not None:
                on_retry(run, failure)


def run_case(case: Case, pool: TargetPool, client_impl: str) -> Outcome:
    """Run one case and report how it went (never raises for test-level problems)."""
    retried: list[str] = []
    try:
        execute_case(case, pool, client_impl,
                     on_retry=lambda run, failure: retried.append(f"run {run} failed"))
    except SpecSkip as exc:
        return Outcome("skip", str(exc))
    except SpecFailure as exc:
        return Outcome("fail", str(exc))
    except RunnerError as exc:
        return Outcome("fail", f"runner: {exc}")
    except Exception as exc:  # an unexpected error is a failure of this case, not of the run
        return Outcome("fail", f"unexpected {type(exc).__name__}: {exc}")
    return Outcome("pass", f"passed after {', '.join(retried)} (CSOT_RUNS)" if retried else "")
