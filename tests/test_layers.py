"""Imports point one way: stack (the composition root) -> services -> greyhound (the library);
inside services, the registry (which loads the services) -> each service -> services.common,
and no service imports another (what two share goes in services.common).

Every module of the three packages is parsed (imports inside functions and under TYPE_CHECKING
included; relative imports resolved) and each import checked against the layer rules; modules
that import each other (an import cycle) are reported too. The checkers run once on the real
tree and once on a forged tree with one violation of each kind, which they must report: a check
that cannot fail would prove nothing.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("greyhound", "services", "stack")
# What the services need and the pure cores must never load (they take numpy, return dataclasses).
SERVICE_FRAMEWORKS = ("nats", "sqlalchemy", "fastapi", "asyncpg", "uvicorn", "pydantic_settings",
                      "alembic")


@dataclass(frozen=True)
class Rule:
    importer: str  # a package prefix
    forbidden: tuple[str, ...]  # top-level or dotted prefixes it must not import
    why: str


RULES = (
    Rule("greyhound", ("services", "stack"), "the library is the bottom layer"),
    Rule("services", ("stack",), "services never import the composition root"),
    Rule("greyhound.core", SERVICE_FRAMEWORKS, "the pure cores do no I/O"),
    Rule("greyhound.core", ("greyhound.sim",),
         "the cores own what a planner needs (plan types); the simulator builds on them"),
    Rule("greyhound.hookabi", SERVICE_FRAMEWORKS, "the hook ABI is read by the library too"),
)


def service_folders(root: Path) -> list[str]:
    """The services: the packages in services/ other than common."""
    base = root / "services"
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir()
                  if (p / "__init__.py").is_file() and p.name != "common")


def rules(root: Path) -> tuple[Rule, ...]:
    """RULES, and those of the tree's own service folders."""
    folders = service_folders(root)
    below = Rule("services.common", ("services.registry", *(f"services.{f}" for f in folders)),
                 "services.common is below every service and the registry that loads them")
    apart = [Rule(f"services.{f}", tuple(f"services.{o}" for o in folders if o != f),
                  "a service imports no other: what two share goes in services.common")
             for f in folders]
    return (*RULES, below, *apart)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, *, runtime: bool) -> list[ast.Import | ast.ImportFrom]:
    """Import statements anywhere in ``tree``; with ``runtime``, not those under TYPE_CHECKING
    (they carry types only and never run)."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        if runtime and _is_type_checking(node):
            assert isinstance(node, ast.If)
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)
    return out


def imported(module: str, path: Path, *, runtime: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, wherever it stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in _imports(tree, runtime=runtime):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join([*base, *([node.module] if node.module else [])])
        else:
            target = node.module or ""
        out.append((node.lineno, target))
        # ``from services import agent`` imports services.agent
        out += [(node.lineno, f"{target}.{a.name}") for a in node.names if a.name != "*"]
    return sorted(out)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for pkg in PACKAGES if (root / pkg).is_dir()
            for p in sorted((root / pkg).rglob("*.py"))}


def violations(root: Path) -> list[str]:
    """One line per import statement that breaks a rule."""
    found: dict[tuple[Path, int, str], str] = {}
    checked = rules(root)
    for module, path in modules(root).items():
        for line, target in imported(module, path):
            for rule in checked:
                bad = [f for f in rule.forbidden if _within(target, f)]
                if _within(module, rule.importer) and bad:
                    found.setdefault((path, line, rule.why), f"{path.relative_to(root)}:{line}: "
                                     f"{module} imports {target} ({rule.why})")
    return sorted(found.values())


def cycles(root: Path, *, types: bool = False, within: str = "") -> list[set[str]]:
    """Groups of modules that import each other, directly or round about (run-time imports,
    function-level ones included: a deferred import hides a cycle, it does not remove it; with
    ``types``, those under TYPE_CHECKING too), among the modules under ``within``."""
    found = {m: p for m, p in modules(root).items() if _within(m, within) or not within}
    graph = {m: {t for _, t in imported(m, p, runtime=not types) if t in found and t != m}
             for m, p in found.items()}
    # Two modules are in one cycle when each reaches the other.
    reach: dict[str, set[str]] = {}
    for m in graph:
        seen, todo = set(), [m]
        while todo:
            for t in graph[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        reach[m] = seen
    groups = {frozenset({m, *(t for t in reach[m] if m in reach[t])}) for m in graph if m in reach[m]}
    return sorted((set(g) for g in groups), key=sorted)


# DETECT is rewriting these three; the fix they need: Detection, LevelState and NORMAL move out
# of detector.py into a module of their own, which bocd.py and window.py import instead.
KNOWN_CYCLES: list[set[str]] = []


def test_no_new_import_cycles() -> None:
    new = [c for c in cycles(REPO) if c not in KNOWN_CYCLES]
    assert new == []


def test_no_import_circle_inside_services_even_for_types() -> None:
    """Inside services the layers hold for type-only imports too: a circle closed under
    TYPE_CHECKING (the registry and common.runtime once were one) is layers tangled."""
    assert cycles(REPO, types=True, within="services") == []


def test_every_package_is_walked() -> None:
    found = modules(REPO)
    for pkg in PACKAGES:
        assert pkg in found, f"package {pkg} not found"
    assert {"greyhound.core.lifecycle", "services.agent.service", "stack.cli"} <= set(found)
    assert sum(1 for m in found if m.startswith("services.")) > 20


def test_imports_point_one_way() -> None:
    assert violations(REPO) == []


def test_the_checker_reports_each_kind_of_violation(tmp_path: Path) -> None:
    files = {
        "greyhound/__init__.py": "",
        "greyhound/core/__init__.py": "",
        "greyhound/core/bad.py": "def f():\n    import nats.aio.client\n",
        "greyhound/core/plan.py": "from greyhound.sim.up import X\n",
        "greyhound/sim/__init__.py": "",
        "greyhound/sim/up.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from services.common.settings import Settings\n",
        "greyhound/sim/rel.py": "from ..core import bad\nfrom .. import hookabi\n",
        "services/__init__.py": "",
        "services/x/__init__.py": "from stack import cli\n",
        "services/x/ok.py": "import greyhound.core.bad\n",
        "services/y/__init__.py": "",
        "services/y/peer.py": "from services import x\n",
        "services/common/__init__.py": "",
        "services/common/runs.py": "from services.registry import SERVICES\n",
        "services/common/knows.py": "def f():\n    import services.x.ok\n",
        "services/registry.py": "import importlib\n",
        "stack/__init__.py": "import services.x\nimport greyhound\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(tmp_path)
    assert len(found) == 7, found
    assert any("greyhound/core/plan.py:1" in v and "greyhound.sim.up" in v for v in found)
    assert any("greyhound/core/bad.py:2" in v and "nats.aio.client" in v for v in found)
    assert any("greyhound/sim/up.py:3" in v and "services.common.settings" in v for v in found)
    assert any("services/x/__init__.py:1" in v and "imports stack" in v for v in found)
    assert any("services/y/peer.py:1" in v and "imports services.x " in v for v in found)
    assert any("services/common/runs.py:1" in v and "services.registry" in v for v in found)
    assert any("services/common/knows.py:2" in v and "services.x.ok" in v for v in found)
    assert imported("greyhound.sim.rel", tmp_path / "greyhound/sim/rel.py")[0] == (
        1, "greyhound.core")
    assert imported("greyhound.sim.up", tmp_path / "greyhound/sim/up.py", runtime=True) == [
        (1, "typing"), (1, "typing.TYPE_CHECKING")]
    (tmp_path / "greyhound/core/__init__.py").write_text("from greyhound.core import bad\n")
    (tmp_path / "greyhound/core/other.py").write_text("def f():\n    import greyhound.core\n")
    forged = {"services.x", "stack"}  # services.x imports stack, which imports services.x
    assert cycles(tmp_path) == [forged]  # bad does not import the package back
    (tmp_path / "services/common/runs.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.common import knows\n")
    (tmp_path / "services/common/knows.py").write_text("import services.common.runs\n")
    assert cycles(tmp_path, within="services.common") == []  # run-time: no circle
    assert cycles(tmp_path, types=True, within="services.common") == [
        {"services.common.knows", "services.common.runs"}]
    (tmp_path / "greyhound/core/bad.py").write_text("from greyhound.core import other\n")
    assert cycles(tmp_path) == [{"greyhound.core", "greyhound.core.bad", "greyhound.core.other"},
                                forged]
