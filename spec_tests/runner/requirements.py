"""Evaluating ``runOnRequirements`` against one deployment.

A list of requirements is met when any one of them is; a requirement is met
when all of its fields are. Every unmet field contributes a readable reason,
which becomes the skip message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import RunnerError
from .loader import parse_version

TOPOLOGIES = frozenset({"single", "replicaset", "sharded", "sharded-replicaset", "load-balanced"})


@dataclass
class ServerInfo:
    """What the requirements are checked against."""

    version: tuple[int, int, int]
    topology: str
    """One of ``single``, ``replicaset``, ``sharded``, ``load-balanced``."""
    serverless: bool = False
    auth: bool = False
    csfle: bool = False
    auth_mechanisms: tuple[str, ...] = ()
    get_parameter: Callable[[str], Any] | None = None
    """Fetches one server parameter (raises KeyError if unknown); None: not connected."""
    _parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))

    def parameter(self, name: str) -> Any:
        if name not in self._parameters:
            assert self.get_parameter is not None
            self._parameters[name] = self.get_parameter(name)
        return self._parameters[name]


_KEYS = frozenset(
    {
        "minServerVersion",
        "maxServerVersion",
        "topologies",
        "serverless",
        "auth",
        "authMechanism",
        "serverParameters",
        "csfle",
    }
)


def unmet(requirement: dict[str, Any], info: ServerInfo) -> list[str]:
    """Why one runOnRequirement is not met (empty: it is met).

    Without a connection (``info.get_parameter is None``) ``serverParameters``
    is assumed met; the executor re-checks with a live connection.
    """
    unknown = set(requirement) - _KEYS
    if unknown:
        raise RunnerError(f"unsupported runOnRequirement fields {sorted(unknown)}")
    reasons: list[str] = []
    low = requirement.get("minServerVersion")
    if low is not None and info.version < parse_version(low):
        reasons.append(f"server {info.version_text} < minServerVersion {low}")
    high = requirement.get("maxServerVersion")
    if high is not None and info.version > parse_version(high):
        reasons.append(f"server {info.version_text} > maxServerVersion {high}")
    topologies = requirement.get("topologies")
    if topologies is not None:
        bad = set(topologies) - TOPOLOGIES
        if bad:
            raise RunnerError(f"unknown topologies {sorted(bad)} in runOnRequirements")
        wanted = {"sharded" if t == "sharded-replicaset" else t for t in topologies}
        if info.topology not in wanted:
            reasons.append(f"topology {info.topology} not in {list(topologies)}")
    serverless = requirement.get("serverless", "allow")
    if serverless == "require" and not info.serverless:
        reasons.append("needs Atlas Serverless")
    elif serverless == "forbid" and info.serverless:
        reasons.append("forbidden on Atlas Serverless")
    elif serverless not in ("require", "forbid", "allow"):
        raise RunnerError(f"bad serverless value {serverless!r}")
    auth = requirement.get("auth")
    if auth is not None and bool(auth) != info.auth:
        reasons.append("needs authentication" if auth else "needs authentication disabled")
    mechanism = requirement.get("authMechanism")
    if mechanism is not None and mechanism.lower() not in (m.lower() for m in info.auth_mechanisms):
        reasons.append(f"server does not offer auth mechanism {mechanism}")
    csfle = requirement.get("csfle")
    if csfle is not None and csfle is not False and not info.csfle:
        reasons.append("needs client-side field level encryption (not available)")
    if csfle is False and info.csfle:
        reasons.append("must not run with client-side field level encryption")
    params = requirement.get("serverParameters")
    if params and info.get_parameter is not None:
        reasons.extend(_unmet_parameters(params, info))
    return reasons


def _unmet_parameters(params: dict[str, Any], info: ServerInfo) -> list[str]:
    from .matcher import values_equal

    reasons = []
    for name, wanted in params.items():
        try:
            actual = info.parameter(name)
        except KeyError:
            reasons.append(f"server parameter {name} is not supported")
            continue
        if not values_equal(wanted, actual):
            reasons.append(f"server parameter {name}={actual!r}, needs {wanted!r}")
    return reasons


def unmet_any(requirements: list[dict[str, Any]] | None, info: ServerInfo) -> str | None:
    """None if the list is absent or one entry is met; else why none is."""
    if not requirements:
        return None
    all_reasons = []
    for requirement in requirements:
        reasons = unmet(requirement, info)
        if not reasons:
            return None
        all_reasons.append(" and ".join(reasons))
    return "runOnRequirements not met: " + "; or ".join(all_reasons)
