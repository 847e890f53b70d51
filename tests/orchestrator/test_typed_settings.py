"""The orchestrator's signatures name the run's settings by type (issue 31 item 3), and those types resolve."""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
from pathlib import Path

import pytest

ORCHESTRATOR = Path(__file__).resolve().parents[2] / "moe_grpo" / "orchestrator"

NOT_YET: dict[str, str] = {}
"""Files whose `run: Any` is left for now, and why."""

TYPED = ("driver", "probe", "pools", "learner_actor", "session", "run_summary", "resume", "initial_weights",
         "placement_plan")
"""Modules whose every annotation must resolve (the run's config is imported there under TYPE_CHECKING only, so a
misspelled name would otherwise pass unnoticed until a type checker or `get_type_hints` reads it)."""


def _untyped(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        params = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [(a.arg, a.annotation) for a in node.args.args + node.args.kwonlyargs]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            params = [(node.target.id, node.annotation)]
        for name, annotation in params:
            if name in ("run", "pools") and isinstance(annotation, ast.Name) and annotation.id == "Any":
                found.append(f"{path.name}:{node.lineno} {name}: Any")
    return found


def test_no_orchestrator_signature_takes_the_run_or_its_pools_as_any():
    """`run: Any` hid what a function reads of the run (a misspelled key failed only when the run got there);
    31 signatures had it. Would have caught driver.py's, probe.py's, pools.py's and learner_actor.py's."""
    found = [hit for path in sorted(ORCHESTRATOR.glob("*.py")) if path.name not in NOT_YET for hit in _untyped(path)]
    assert not found, f"annotate these with RunConfig / Pools (or the part of the run they read): {found}"


def _annotated(module: object) -> list[object]:
    out = []
    for _, value in vars(module).items():
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            out.append(value)
        elif inspect.isclass(value):
            out.append(value)
            out.extend(v for v in vars(value).values() if inspect.isfunction(v))
    return out


@pytest.mark.parametrize("name", TYPED)
def test_every_annotation_of_the_typed_modules_resolves(name: str):
    """An annotation names a type that exists: with `from __future__ import annotations` and RunConfig imported
    under TYPE_CHECKING, a wrong name is never evaluated by a run."""
    module = importlib.import_module(f"moe_grpo.orchestrator.{name}")
    namespace = dict(vars(module))
    tree = ast.parse(Path(module.__file__).read_text())
    for node in tree.body:  # what the module imports for its annotations only, imported here
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            exec(compile(ast.Module(body=node.body, type_ignores=[]), module.__file__, "exec"), namespace)
    for obj in _annotated(module):
        typing.get_type_hints(obj, globalns=namespace)  # raises NameError naming the unresolved type
