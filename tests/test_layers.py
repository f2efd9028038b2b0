"""The package's dependencies run one way (README, "Layout"):

    format <- ops <- runtime <- distributed <- integrations <- (sim, pytest_plugin) <- bench <- (demo, selfcheck) <- soak <- fuzz <- cli

(``distributed`` below ``integrations``: an engine adapter with tensor-parallel ranks runs the TP consistency check.)

A module may import its own subpackage and anything on a lower level, never a higher level and never a
sibling on its own level. Every import counts, including the ones inside functions: a lazy upward
import is still a cycle waiting for its first call.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvcanary"
LEVELS = {
    "kvcanary.format": 0,
    "kvcanary.ops": 1,
    "kvcanary.runtime": 2,
    "kvcanary.distributed": 3,
    "kvcanary.integrations": 3.5,
    "kvcanary.sim": 4,
    "kvcanary.pytest_plugin": 4,
    "kvcanary.bench": 5,
    "kvcanary.soak": 7,
    "kvcanary.fuzz": 8,
    "kvcanary.cli": 9,
    "kvcanary.demo": 6,
    "kvcanary.vllm_demo": 6,
    "kvcanary.selfcheck": 6,
}


def unit_of(module: str) -> str | None:
    """The layered unit a dotted module name belongs to (None: the root package or outside the project)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "kvcanary" and len(parts) > 1 else None


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) for every import in ``source``; ``from pkg import name`` counts as ``pkg.name``."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}" if base == "kvcanary" else base) for a in node.names]
    return out


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Imports of ``module`` that break the layering, as 'module:line imports target' strings."""
    own = unit_of(module)
    if own is None:
        return []
    if own not in LEVELS:
        return [f"{module}: not in the layer table; give {own} a level"]
    bad = []
    for line, target in imported_modules(source, module, is_package):
        unit = unit_of(target)
        if unit is None or unit == own:
            continue
        if unit not in LEVELS:
            bad.append(f"{module}:{line} imports {target}, which is not in the layer table")
        elif LEVELS[unit] >= LEVELS[own]:
            bad.append(f"{module}:{line} imports {target} (level {LEVELS[unit]} >= {own}'s {LEVELS[own]})")
    return sorted(set(bad))


def test_no_module_imports_upward_or_sideways():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        bad += upward_imports(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module, source", [
    ("kvcanary.runtime.canary", "from kvcanary.sim import SimEngine\n"),
    ("kvcanary.runtime.canary", "def f():\n    from kvcanary.integrations import transformers\n"),
    ("kvcanary.ops.api", "import kvcanary.runtime.batch\n"),
    ("kvcanary.ops.api", "from kvcanary import runtime\n"),
    ("kvcanary.sim.recall", "from kvcanary.bench.suite import table\n"),
    ("kvcanary.distributed.consistency", "from kvcanary.integrations.vllm import session\n"),
    ("kvcanary.runtime.batch", "from ..sim import engine\n"),
])
def test_an_upward_or_sideways_import_is_caught(module, source):
    assert upward_imports(source, module)


@pytest.mark.parametrize("module, source", [
    ("kvcanary.runtime.canary", "from kvcanary.ops import validate\nfrom kvcanary.format import launch_tag\n"),
    ("kvcanary.sim.engine", "from kvcanary.runtime import Canary\nfrom .config import SimConfig\n"),
    ("kvcanary.cli", "def f():\n    from kvcanary.bench import suite\n"),
    ("kvcanary.ops.api", "import torch\nimport kvcanary\n"),
])
def test_a_downward_or_internal_import_passes(module, source):
    assert upward_imports(source, module) == []


# Only the canary and its own helpers (the modules directly in ``runtime/``) write the fields of ``Canary``,
# ``Monitor`` and ``ForwardLauncher``: everything else (the step runner in ``runtime/step``, the adapters, the
# simulated engine, ...) drives them through Canary's public methods and the attributes an engine sets by its
# protocol (issues 35 and 57).
ENGINE_SET = {"sweep_provider", "head_overlap", "padding_tokens", "host_times"}  # (host_times: benchmarks' probe)


def _chain(node: ast.AST) -> list[str]:
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


def _pairs(node: ast.AST) -> list[tuple[ast.AST, ast.AST | None]]:
    """(target, value) of each name or attribute an assignment writes (tuples unpacked; value None where a
    tuple target takes a value that is not a tuple of as many)."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets, value = [node.target], node.value
    else:
        return []
    out = []
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(t.elts) \
                else [None] * len(t.elts)
            out += list(zip(t.elts, values))
        else:
            out.append((t, value))
    return out


def _runtime_writes(source: str) -> list[tuple[int, str]]:
    """(line, dotted target) of each write into the canary's objects: through ``...canary...`` or a local
    name bound to such an expression, however indirectly (``c = self.canary``, ``mon = c.monitor``, ``mon.x =
    1``), past ``ENGINE_SET``."""
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        alias: dict[str, list[str]] = {}

        def resolved(chain: list[str]) -> list[str]:
            return alias[chain[0]] + chain[1:] if chain and chain[0] in alias else chain

        for node in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
            for t, value in _pairs(node):
                if isinstance(t, ast.Name) and isinstance(value, (ast.Attribute, ast.Name)):
                    chain = resolved(_chain(value))
                    if "canary" in chain:
                        alias[t.id] = chain[chain.index("canary"):]
        for node in ast.walk(fn):
            for target, _ in _pairs(node):
                if not isinstance(target, ast.Attribute):
                    continue  # (binding a local name writes nothing)
                chain = resolved(_chain(target))
                if "canary" not in chain[:-1]:
                    continue
                after = chain[chain.index("canary") + 1:]
                if len(after) > 1 or after[0] not in ENGINE_SET:
                    out.append((node.lineno, ".".join(["canary", *after])))
    return sorted(set(out))


def test_only_the_canary_and_its_helpers_write_its_fields():
    helpers = set((PACKAGE / "runtime").glob("*.py"))
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} writes {target}"
           for path in sorted(PACKAGE.rglob("*.py")) if path not in helpers
           for line, target in _runtime_writes(path.read_text())]
    assert not bad, "\n".join(bad)


def test_runtime_writes_are_found_through_aliases():
    src = ("def f(self):\n    self.canary.launcher.graphs = 1\n    obs = self.s.canary.monitor.observer\n"
           "    obs.graphs = 2\n    self.canary.sweep_provider = 3\n    self.canary._open = 4\n"
           "    b, c = self.bound, self.canary\n    mon = c.monitor\n    mon.forwards += 1\n"
           "    launcher = c.launcher\n    launcher.inputs, launcher.key = 5, 6\n    c.padding_tokens = 0\n")
    assert [t for _, t in _runtime_writes(src)] == ["canary.launcher.graphs", "canary.monitor.observer.graphs",
                                                   "canary._open", "canary.monitor.forwards",
                                                   "canary.launcher.inputs", "canary.launcher.key"]
