"""The package's dependencies run one way (README, "Layout"):

    format <- ops <- runtime <- (integrations, distributed) <- (sim, pytest_plugin) <- bench <- (demo, selfcheck) <- soak <- cli

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
    "kvcanary.integrations": 3,
    "kvcanary.distributed": 3,
    "kvcanary.sim": 4,
    "kvcanary.pytest_plugin": 4,
    "kvcanary.bench": 5,
    "kvcanary.soak": 7,
    "kvcanary.cli": 8,
    "kvcanary.demo": 6,
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
    ("kvcanary.integrations.transformers.batch", "from kvcanary.distributed import pack\n"),
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
