"""Imports at the top of each module, except those moe_grpo/deferred_imports.py names (read from the source)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from moe_grpo.deferred_imports import DEFERRED

PACKAGE = Path(__file__).resolve().parents[1] / "moe_grpo"

PENDING: dict[str, str] = {}
"""Files whose imports inside functions are not checked yet, and why (each must still have one to move)."""

OPTIONAL = ("ImportError", "ModuleNotFoundError")


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """What an import statement imports: module names (a moe_grpo module, else the package's dotted name)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".")
        keep = len(here) - node.level + (1 if MODULES[module].name == "__init__.py" else 0)
        base = ".".join(here[:keep] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), str(MODULES[module]))


@cache
def _top_level(module: str) -> frozenset[str]:
    """What importing `module` runs imports of: its module-level statements (not TYPE_CHECKING blocks)."""
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update(_targets(module, node))
            elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(_tree(module).body)
    return frozenset(out)


def deferred_reached(module: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
    """The DEFERRED packages that importing `module` imports (through its packages and top-level imports)."""
    if module in seen:
        return frozenset()
    seen = seen | {module}
    out: set[str] = set()
    parts = module.split(".")
    for package in (".".join(parts[:i]) for i in range(1, len(parts))):
        out |= deferred_reached(package, seen) if package in MODULES else set()
    for target in _top_level(module):
        if target.split(".")[0] == "moe_grpo":
            owner = target if target in MODULES else target.rsplit(".", 1)[0]
            out |= deferred_reached(owner, seen) if owner in MODULES else set()
        elif target.split(".")[0] in DEFERRED:
            out.add(target.split(".")[0])
    return frozenset(out)


def _inside_functions(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(import statement, whether a `try` handling ImportError holds it) for every import inside a function."""
    found = []

    def visit(node: ast.AST, in_function: bool, optional: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                found.append((child, optional))
            handles = isinstance(child, ast.Try) and any(
                h.type is not None and any(isinstance(n, ast.Name) and n.id in OPTIONAL for n in ast.walk(h.type))
                for h in child.handlers)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                  optional or handles)

    visit(tree, False, False)
    return found


def why_not_at_the_top(module: str, tree: ast.Module | None = None) -> list[str]:
    """Each import inside a function of `module` (of `tree`, its source, when given) that has no reason to be
    there, as `file:line: import ...`."""
    mine = deferred_reached(module)
    out = []
    for node, optional in _inside_functions(_tree(module) if tree is None else tree):
        if optional:
            continue
        hides = set()
        for target in _targets(module, node):
            top = target.split(".")[0]
            if top == "moe_grpo":
                owner = target if target in MODULES else target.rsplit(".", 1)[0]
                hides |= deferred_reached(owner) - mine
            elif top in DEFERRED and top not in mine:
                hides.add(top)
        if not hides:
            where = MODULES[module].relative_to(PACKAGE.parent)
            out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return out


def _pending(module: str) -> str | None:
    path = str(MODULES[module].relative_to(PACKAGE.parent))
    return next((p for p in PENDING if path == p or (p.endswith("/") and path.startswith(p))), None)


def test_imports_inside_functions_keep_a_heavy_or_optional_package_out_of_the_module():
    """Every import inside a function names a package of DEFERRED the module does not already import, a moe_grpo
    module that brings one in, or an optional package in a try; anything else belongs at the top. Would catch the
    374 imports inside functions the issue counted (46 in driver.py), and a new one written out of habit."""
    misplaced = [line for module in sorted(MODULES) if not _pending(module) for line in why_not_at_the_top(module)]
    assert not misplaced, (f"{len(misplaced)} import(s) inside functions hide nothing heavy (moe_grpo/"
                           "deferred_imports.py says which may wait); move them to the top of the module:\n"
                           + "\n".join(misplaced))


def test_every_pending_file_still_has_an_import_to_move():
    """An exemption in PENDING outlives its reason once its file is done: then it must go."""
    done = [p for p in PENDING if not any(why_not_at_the_top(m) for m in MODULES if _pending(m) == p)]
    assert not done, f"no import left to move in {done}: remove them from PENDING"


def test_the_check_names_a_misplaced_import_and_accepts_a_deferred_one():
    """The check itself: in a module that imports nothing heavy, `import json` inside a function is named and
    `import torch` is accepted (so is an optional package in a try); in one that imports torch at the top, a
    deferred torch is named (it hides nothing)."""
    light, heavy = "moe_grpo.validate", "moe_grpo.learner.megatron_learner"
    assert "torch" not in deferred_reached(light) and "torch" in deferred_reached(heavy)
    optional = "def f():\n    try:\n        import json\n    except ImportError:\n        pass\n"
    for module, function, named in [(light, "def f():\n    import json\n", True),
                                    (light, "def f():\n    import torch\n", False),
                                    (light, optional, False),
                                    (heavy, "def f():\n    import torch\n", True)]:
        tree = ast.parse(MODULES[module].read_text() + "\n\n" + function)
        assert bool(why_not_at_the_top(module, tree)) is named, (module, function)
