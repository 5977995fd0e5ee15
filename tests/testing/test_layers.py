"""The simulator's structure: layers without import cycles, and no module-level state.

Every import statement of ``changestream/testing`` counts, at module level or
inside a function, except those under ``if TYPE_CHECKING:`` (annotations only:
never executed, so they can name a type of any layer). A module may import its
own layer or the layers below it, never one above, and no set of modules may
import each other in a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import changestream.testing

PACKAGE = "changestream.testing"
ROOT = Path(changestream.testing.__file__).parent

LAYERS = (
    "core", "storage", "update", "changestreams", "commands", "server", "replset", "sharding", "api"
)  # fmt: skip
"""Bottom to top. Each subpackage is one layer; ``replset`` is the module of that name (the
sharded cluster is built from replica sets); the package's other own modules are the API."""
API_MODULES = frozenset({PACKAGE, f"{PACKAGE}.cli", f"{PACKAGE}.__main__"})


# -- the module graph ------------------------------------------------------------------------------


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in (child, *_runtime_nodes(child)))
            continue
        yield node
        yield from _runtime_nodes(node)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``module`` imports at run time (top level or in functions)."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)  # ``from . import wire``: the module itself
                elif target in modules:
                    found.add(target)
    found.discard(module)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None (iterative depth-first search)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path = [start]
        stack = [iter(sorted(graph.get(start, ())))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(path.pop())
            elif nxt in path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in done:
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def layer_of(module: str) -> str:
    if module in API_MODULES:
        return "api"
    sub = module.removeprefix(PACKAGE + ".").split(".")[0]
    if sub not in LAYERS:
        raise AssertionError(
            f"{module} belongs to no layer: put it in a layer's subpackage "
            f"({', '.join(LAYERS[:-1])}) or list it in API_MODULES"
        )
    return sub


# -- the simulator's structure ---------------------------------------------------------------------


def test_the_simulator_has_no_import_cycle() -> None:
    graph = import_graph(ROOT, PACKAGE)
    assert len(graph) > 40, "the scan found the simulator's modules"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_each_layer_imports_only_itself_and_the_layers_below() -> None:
    wrong = [
        f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})"
        for src, targets in sorted(import_graph(ROOT, PACKAGE).items())
        for dst in sorted(targets)
        if LAYERS.index(layer_of(dst)) > LAYERS.index(layer_of(src))
    ]
    assert not wrong, "\n".join(wrong)


def test_the_core_imports_nothing_above_it() -> None:
    graph = import_graph(ROOT, PACKAGE)
    core = {m: deps for m, deps in graph.items() if layer_of(m) == "core"}
    assert core, "the core layer exists"
    assert all(layer_of(dep) == "core" for deps in core.values() for dep in deps)


def client_imports(root: Path, package: str, client: str) -> list[str]:
    """Every import (at any level, annotation-only ones included) of ``client`` outside
    ``package``, as ``"module imports target (line n)"``."""
    wrong = []
    for module, path in module_files(root, package).items():
        base = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported_modules(node, base):
                inside = target == package or target.startswith(package + ".")
                if (target == client or target.startswith(client + ".")) and not inside:
                    wrong.append(f"{module} imports {target} (line {getattr(node, 'lineno', 0)})")
    return wrong


def _imported_modules(node: ast.AST, package: str) -> list[str]:
    """The absolute module names an import statement names (relative ones resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if not node.level:
            return [node.module or ""]
        base = package.split(".")
        base = base[: len(base) - node.level + 1]
        return [".".join(base + ([node.module] if node.module else []))]
    return []


def test_the_simulator_imports_nothing_from_the_client() -> None:
    """``changestream.testing`` stands alone: it imports nothing of ``changestream`` outside it."""
    assert client_imports(ROOT, PACKAGE, "changestream") == []


def test_a_client_import_is_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from . import core\n",
            "core/__init__.py": "",
            "core/a.py": "from .. import core\nfrom ... import errors\n",
            "core/b.py": "def f():\n    import outer._token\n",
            "core/c.py": "import typing\nif typing.TYPE_CHECKING:\n    from outer.events import E\n",
        },
    )
    assert sorted(client_imports(root, "outer.pkg", "outer")) == [
        "outer.pkg.core.a imports outer (line 2)",
        "outer.pkg.core.b imports outer._token (line 2)",
        "outer.pkg.core.c imports outer.events (line 3)",
    ]


FENCE = f"{PACKAGE}.core._mongomock"
"""The one module allowed to import mongomock (its internals are listed at its top)."""


def importers_of(root: Path, package: str, target: str) -> list[str]:
    """Every module of ``package`` that imports ``target`` (at any level, annotation-only
    imports included), as ``"module (line n)"``."""
    found = []
    for module, path in module_files(root, package).items():
        base = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported_modules(node, base):
                if name == target or name.startswith(target + "."):
                    found.append(f"{module} (line {getattr(node, 'lineno', 0)})")
    return found


def test_only_the_fence_imports_mongomock() -> None:
    """mongomock's untyped internals are reached through ``core/_mongomock.py`` alone, so a
    new mongomock is checked in one place (issue 29)."""
    client_root = ROOT.parent
    users = importers_of(client_root, "changestream", "mongomock")
    assert any(u.startswith(FENCE + " ") for u in users), "the fence imports mongomock"
    assert [u for u in users if not u.startswith(FENCE + " ")] == []


def test_a_mongomock_import_outside_the_fence_is_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    from mongomock import aggregate\n",
            "b.py": "import mongomock.filtering as f\n",
            "c.py": "import mongomockery\n",
        },
    )
    assert sorted(importers_of(root, "pkg", "mongomock")) == ["pkg.a (line 2)", "pkg.b (line 1)"]


def test_the_fence_lists_every_mongomock_name_it_touches() -> None:
    """Each mongomock attribute the fence reads is named in its docstring."""
    from changestream.testing.core import _mongomock

    path = Path(_mongomock.__file__)
    tree = ast.parse(path.read_text())
    aliases = {"mongomock"} | {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "mongomock"
        for alias in node.names
    }
    touched = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
    }
    assert {"filter_applies", "_Parser", "_PIPELINE_HANDLERS", "process_pipeline"} <= touched
    doc = _mongomock.__doc__ or ""
    assert [name for name in sorted(touched) if name not in doc] == []


MAX_LINES = 750
LONG_BY_NATURE = {f"{PACKAGE}.changestreams.keystring": "one codec, mongod's KeyString format"}


def test_no_module_is_over_750_lines() -> None:
    """One responsibility per module: a module past 750 lines holds more than one (issue 29)."""
    long = {
        module: n
        for module, path in module_files(ROOT, PACKAGE).items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES and module not in LONG_BY_NATURE
    }
    assert long == {}, f"split these by concern: {long}"


def test_command_modules_are_listed_in_the_registry() -> None:
    """Every module of ``commands`` that defines a command is in the explicit list."""
    from changestream.testing.commands import registry
    from changestream.testing.commands.spec import specs_of

    listed = {module.__name__ for module in registry.MODULES}
    for name, path in module_files(ROOT / "commands", f"{PACKAGE}.commands").items():
        if "@command(" in path.read_text():
            assert name in listed, f"{name} defines commands but registry.MODULES omits it"
    from changestream.testing.sharding.commands import registry as router_registry

    listed = {module.__name__ for module in router_registry.MODULES}
    routes = f"{PACKAGE}.sharding.commands"
    for name, path in module_files(ROOT / "sharding" / "commands", routes).items():
        if "@router_command(" in path.read_text():
            assert name in listed, f"{name} defines mongos commands but MODULES omits it"
    for module in registry.MODULES:
        for value in vars(module).values():
            for command_name, spec in specs_of(value):
                assert registry.REGISTRY[command_name].handler is spec.handler


def test_the_registry_is_read_only() -> None:
    from changestream.testing.commands import REGISTRY

    with pytest.raises(TypeError):
        REGISTRY["new"] = REGISTRY["ping"]  # type: ignore[index]


# -- module-level state ----------------------------------------------------------------------------

_STATEFUL_CALLS = frozenset(
    {
        "Lock",
        "RLock",
        "Condition",
        "Event",
        "Semaphore",
        "count",
        "WeakKeyDictionary",
        "WeakValueDictionary",
        "WeakSet",
        "defaultdict",
        "OrderedDict",
        "deque",
        "dict",
        "list",
        "set",
        "Random",
    }
)
ALLOWED_STATE = {
    f"{PACKAGE}.changestreams.keystring._FIELD_NAMES": (
        "a bounded memo of a pure function (field name -> its C string): it never changes a result"
    ),
}


def _is_state(value: ast.expr | None) -> bool:
    """An empty container, or a lock/counter/cache: something filled or changed at run time."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set)):
        return not (value.keys if isinstance(value, ast.Dict) else value.elts)
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in _STATEFUL_CALLS
    return False


def module_state(root: Path, package: str) -> list[str]:
    found = []
    for module, path in module_files(root, package).items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                targets = [node.target.id]
            else:
                continue
            if _is_state(node.value):
                found += [f"{module}.{t}" for t in targets if f"{module}.{t}" not in ALLOWED_STATE]
    return found


def test_no_module_keeps_state_of_its_own() -> None:
    """Locks, conditions, counters and registries live on a Deployment, never in a module."""
    assert module_state(ROOT, PACKAGE) == []


# -- the checks themselves catch what they look for ------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": "def f():\n    from ..server import b\n",
            "server/__init__.py": "",
            "server/b.py": "from ..core import a\n",
            "server/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n",
            "server/d.py": "from . import c\n",
        },
    )
    graph = import_graph(root, "pkg")
    assert graph["pkg.core.a"] == {"pkg.server.b"}
    assert graph["pkg.server.c"] == set(), "annotation-only imports are not followed"
    assert find_cycle(graph) == ["pkg.core.a", "pkg.server.b", "pkg.core.a"]
    del graph["pkg.core.a"]
    assert find_cycle(graph) is None


def test_module_state_is_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "m.py": """\
                import threading, itertools
                TABLE = {1: "one"}
                _cache: dict[str, int] = {}
                _lock = threading.Lock()
                _ids = itertools.count(1)
            """,
        },
    )
    assert sorted(module_state(root, "pkg")) == ["pkg.m._cache", "pkg.m._ids", "pkg.m._lock"]


def test_a_command_module_that_fails_to_import_fails_the_registry() -> None:
    """No optional command module: a missing one is an error, not a smaller registry."""
    code = (
        "import sys\n"
        "sys.modules['changestream.testing.commands.listing'] = None\n"
        "import changestream.testing.commands\n"
    )
    env_path = str(ROOT.parents[1])
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr and "commands.listing" in result.stderr
