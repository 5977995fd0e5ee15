"""Finding and parsing the spec test files (Extended JSON, canonical or relaxed).

The files are read in place from ``$SPEC_TESTS_DIR``, ``<checkout>/../shared/spec``
or ``<checkout>/.spec`` (where ``python -m spec_tests.sync`` downloads them, at
the pinned commit); they are never committed to the project.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bson import json_util
from bson.json_util import JSONOptions

from . import RunnerError

SCOPE = (
    "change-streams/unified/*.json",
    "related/retryable-reads/changeStreams-*.json",
    "csot/tests/change-streams.json",
    "related/unified-test-format-valid-pass/poc-change-streams.json",
)
"""The files this runner is for, relative to the spec directory."""

SUPPORTED_SCHEMA = (1, 9)
"""Highest schemaVersion whose features the runner implements (1.x only)."""

_JSON_OPTIONS = JSONOptions(tz_aware=False)
"""Parse like PyMongo decodes replies (naive UTC datetimes, Int64 for $numberLong)."""

_TOP_LEVEL_KEYS = frozenset(
    {
        "description",
        "schemaVersion",
        "runOnRequirements",
        "createEntities",
        "initialData",
        "tests",
        "_yamlAnchors",
    }
)


SYNC_COMMAND = "python -m spec_tests.sync"
"""How to fetch the spec files into a clone that has none (see :mod:`spec_tests.sync`)."""

REQUIRED_ENV = "SPEC_TESTS_REQUIRED"
"""Set to ``1`` (CI does) to make missing spec files an error instead of a skip."""


def checkout_dir() -> Path:
    """The root of this checkout (the directory holding ``spec_tests/``)."""
    return Path(__file__).resolve().parents[2]


def downloaded_dir() -> Path:
    """Where ``python -m spec_tests.sync`` puts the files: ``<checkout>/.spec`` (git-ignored)."""
    return checkout_dir() / ".spec"


def spec_dir() -> Path:
    """The spec directory, first found of: ``$SPEC_TESTS_DIR``, ``<checkout>/../shared/spec``,
    ``<checkout>/.spec`` (downloaded by ``python -m spec_tests.sync``).

    ``$SPEC_TESTS_DIR`` wins even when it does not exist (an explicit choice is
    never silently replaced); with none found, the ``../shared/spec`` path is
    returned so that error messages name it.
    """
    env = os.environ.get("SPEC_TESTS_DIR")
    if env:
        return Path(env).resolve()
    shared = (checkout_dir().parent / "shared" / "spec").resolve()
    if shared.is_dir():
        return shared
    downloaded = downloaded_dir()
    if downloaded.is_dir():
        return downloaded
    return shared


def missing_reason() -> str | None:
    """``None`` when the spec files are here, else one line saying how to get them."""
    base = spec_dir()
    if base.is_dir() and any(any(base.glob(scope)) for scope in SCOPE):
        return None
    where = "$SPEC_TESTS_DIR" if os.environ.get("SPEC_TESTS_DIR") else "../shared/spec or .spec"
    return f"spec test files not found ({where}): run `{SYNC_COMMAND}` to download them"


def spec_required() -> bool:
    """Whether missing spec files must fail the run (``SPEC_TESTS_REQUIRED=1``, as in CI)."""
    return os.environ.get(REQUIRED_ENV, "").strip() not in ("", "0")


def parse_extended_json(text: str) -> Any:
    """Parse Extended JSON (relaxed or canonical) into BSON-typed Python values."""
    return json_util.loads(text, json_options=_JSON_OPTIONS)


def parse_version(text: str) -> tuple[int, int, int]:
    """``"4.2"`` -> ``(4, 2, 0)``; anything after major.minor.patch is discarded."""
    parts: list[int] = []
    for piece in text.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            raise RunnerError(f"malformed version string {text!r}")
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


@dataclass(frozen=True)
class SpecFile:
    """One parsed test file."""

    path: Path
    label: str
    """Short readable name used in test ids (e.g. ``change-streams.json``)."""
    data: dict[str, Any]

    @property
    def tests(self) -> list[dict[str, Any]]:
        return list(self.data["tests"])

    @property
    def run_on(self) -> list[dict[str, Any]] | None:
        value = self.data.get("runOnRequirements")
        return None if value is None else list(value)


def label_for(path: Path, root: Path) -> str:
    """``change-streams.json`` for the change-streams spec, ``<dir>/<name>`` otherwise."""
    rel = path.relative_to(root).parts
    if rel[:2] == ("change-streams", "unified"):
        return path.name
    top = rel[1] if rel[0] == "related" and len(rel) > 2 else rel[0]
    return f"{top}/{path.name}"


def load_spec_file(path: Path, root: Path) -> SpecFile:
    """Parse one file and check that this runner may interpret it."""
    try:
        data = parse_extended_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunnerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("tests"), list):
        raise RunnerError(f"{path}: not a unified test file (no 'tests' array)")
    unknown = set(data) - _TOP_LEVEL_KEYS
    if unknown:
        raise RunnerError(f"{path}: unsupported top-level keys {sorted(unknown)}")
    schema = str(data.get("schemaVersion", ""))
    major, minor, _ = parse_version(schema)
    if major != SUPPORTED_SCHEMA[0] or minor > SUPPORTED_SCHEMA[1]:
        supported = ".".join(map(str, SUPPORTED_SCHEMA))
        raise RunnerError(
            f"{path.name}: schemaVersion {schema} is not supported (runner supports 1.0-{supported})"
        )
    return SpecFile(path=path, label=label_for(path, root), data=data)


def discover(pattern: str | None = None, root: Path | None = None) -> list[Path]:
    """The in-scope files, optionally filtered by a glob on their path or name."""
    base = root or spec_dir()
    if not base.is_dir():
        raise RunnerError(
            f"spec directory {base} does not exist (set SPEC_TESTS_DIR or run `{SYNC_COMMAND}`)"
        )
    found: list[Path] = []
    for scope in SCOPE:
        found.extend(sorted(base.glob(scope)))
    if not found:
        raise RunnerError(f"no spec test files under {base} (looked for {', '.join(SCOPE)})")
    if pattern:
        found = [
            p
            for p in found
            if fnmatch.fnmatch(p.name, pattern)
            or fnmatch.fnmatch(str(p.relative_to(base)), pattern)
            or fnmatch.fnmatch(label_for(p, base), pattern)
        ]
    return found
