"""The Spark adapter's boundary: the public client API plus the internals CONTRIBUTING names.

Every import statement of ``changestream/spark_adapter`` counts (module level
or inside a function). An internal name (from a ``changestream._module``) is
allowed only if it is in :data:`ALLOWED`, and :data:`ALLOWED` must be exactly
the list in CONTRIBUTING.md and exactly what the adapter uses, so neither the
rule nor the code can drift from the other. No PySpark needed: the files are
parsed, not imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "changestream" / "spark_adapter"

ALLOWED = frozenset({
    "_codes.CHANGE_STREAM_HISTORY_LOST",
    "_consumer.retry.RetryPolicy",
    "_consumer.retry.is_transient",
    "_js_code.JsCode",
    "_js_code.code_held",
    "_js_code.code_json",
    "_js_code.decode_all_held",
    "_js_code.unmarked",
    "_snapshot.SnapshotPosition",
    "_snapshot.copy_pipeline",
    "_snapshot.snapshot_concern",
    "_snapshot.stream_start",
    "_token.ResumeToken",
    "_token.raw_token_bytes",
})
"""``_module.name`` of every client internal the adapter may import."""


def internal_imports(package: Path, package_name: str = "changestream.spark_adapter") -> set[str]:
    """``_module.name`` of every import of a client internal in ``package`` (whole modules as
    ``_module.*``)."""
    found: set[str] = set()
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "changestream" and len(parts) > 1 and parts[1].startswith("_"):
                        found.add(f"{parts[1]}.*")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    depth = len(package_name.split(".")) + (path.parent != package) - node.level + 1
                    base = package_name.split(".")[:depth]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                parts = module.split(".")
                if parts[0] != "changestream":
                    continue
                if len(parts) == 1:  # from changestream import X: X may be an internal module
                    found.update(f"{a.name}.*" for a in node.names if a.name.startswith("_"))
                elif parts[1].startswith("_"):
                    found.update(f"{'.'.join(parts[1:])}.{alias.name}" for alias in node.names)
    return found


def contributing_list() -> set[str]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    rule = re.search(r"^- The Spark adapter .*?(?=^- |^#)", text, re.S | re.M)
    assert rule is not None, "CONTRIBUTING.md states the Spark adapter's boundary rule"
    return set(re.findall(r"`(_\w+(?:\.\w+)+)`", rule.group(0)))


def test_the_adapter_imports_only_public_api_and_the_listed_internals() -> None:
    used = internal_imports(ADAPTER)
    assert used - ALLOWED == set(), (
        "the Spark adapter imports client internals outside its boundary (CONTRIBUTING.md): "
        f"{sorted(used - ALLOWED)}; use the public API, or list the name there and here"
    )
    assert ALLOWED - used == set(), f"listed but no longer used: {sorted(ALLOWED - used)}"


def test_contributing_names_exactly_the_allowed_internals() -> None:
    assert contributing_list() == ALLOWED


def test_the_scan_finds_internal_imports(tmp_path: Path) -> None:
    package = tmp_path / "spark_adapter"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text(
        "from .. import watch\nfrom .._stream import ChangeStream\n"
        "def f():\n    import changestream._machine\n"
    )
    (package / "sub" / "b.py").write_text("from ..._token import ResumeToken\nimport json\n")
    assert internal_imports(package) == {
        "_stream.ChangeStream", "_machine.*", "_token.ResumeToken"
    }
