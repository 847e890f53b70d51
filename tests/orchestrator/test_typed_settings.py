"""The orchestrator's signatures name the run's settings by type (issue 31 item 3), and those types resolve."""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "moe_grpo"
ORCHESTRATOR = PACKAGE / "orchestrator"

NOT_YET: dict[str, str] = {}
"""Files whose `run: Any` is left for now, and why."""

TYPED = ("driver", "probe", "pools", "learner_actor", "session", "run_summary", "resume", "initial_weights",
         "placement_plan")
"""Modules whose every annotation must resolve (the run's config is imported there under TYPE_CHECKING only, so a
misspelled name would otherwise pass unnoticed until a type checker or `get_type_hints` reads it)."""


def _is_any(annotation: ast.expr | None) -> bool:
    """`Any`, `Any | None`, `Optional[Any]` (and the same as strings)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        sides = (annotation.left, annotation.right)
        return any(_is_any(x) for x in sides) and all(_is_any(x) or (isinstance(x, ast.Constant) and x.value is None)
                                                      for x in sides)
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        return annotation.value.id == "Optional" and _is_any(annotation.slice)
    return False


def _untyped(path: Path, names: tuple[str, ...] = ("run", "pools")) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        params = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [(a.arg, a.annotation) for a in node.args.args + node.args.kwonlyargs]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            params = [(node.target.id, node.annotation)]
        for name, annotation in params:
            if name in names and _is_any(annotation):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}: Any")
    return found


def test_no_orchestrator_signature_takes_the_run_or_its_pools_as_any():
    """`run: Any` hid what a function reads of the run (a misspelled key failed only when the run got there);
    31 signatures had it. Would have caught driver.py's, probe.py's, pools.py's and learner_actor.py's."""
    found = [hit for path in sorted(ORCHESTRATOR.glob("*.py")) if path.name not in NOT_YET for hit in _untyped(path)]
    assert not found, f"annotate these with RunConfig / Pools (or the part of the run they read): {found}"


SECTIONS = ("spec", "rollout", "sync", "lora")
"""Parameters and fields named for a part of the run's settings: the model's `MoEModelSpec`, the `rollout`
section (`RolloutConfig`), `sync` (the `SyncConfig` section, or the `SyncLayout` a run computed from it), `lora`
(`LoraConfig`)."""

SECTIONS_NOT_YET: dict[str, str] = {}
"""Files under moe_grpo/ whose settings sections are left `Any` for now, and why."""


def test_no_signature_takes_a_settings_section_as_any():
    """`lora: Any`, `rollout: Any`, `sync: Any`, `spec: Any` hid which settings a function reads, as `run: Any` did.
    Would have caught engine_actor.py's spec/rollout/sync/lora, engine_pool.py's rollout, learner_actor.py's sync and
    the `lora: Any` of sync/plan.py, sync/dtypes.py and rollout/engine_adapters.py."""
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             if str(path.relative_to(PACKAGE)) not in SECTIONS_NOT_YET for hit in _untyped(path, SECTIONS)]
    assert not found, ("annotate these with the section's dataclass (under TYPE_CHECKING when it lives in a layer "
                       f"above): {found}")


def test_the_section_check_sees_every_spelling_of_any():
    tree = ast.parse("def f(lora: Any, sync: 'Any | None', spec: Optional[Any], rollout: RolloutConfig): pass")
    args = tree.body[0].args.args
    assert [_is_any(a.annotation) for a in args] == [True, True, True, False]


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


SECTIONS_TYPED = ("orchestrator.engine_actor", "orchestrator.engine_pool", "rollout.context", "rollout.engine_adapters",
                  "rollout.export", "rollout.lora_serving", "rollout.vllm_engine", "sync.dtypes", "sync.plan",
                  "sync.weight_sync", "data.tokenizer", "checkpoint.hf_init", "rollout.engine_setup")
"""Modules whose settings sections are named by types imported under TYPE_CHECKING: each must resolve too."""


@pytest.mark.parametrize("name", [f"orchestrator.{n}" for n in TYPED] + list(SECTIONS_TYPED))
def test_every_annotation_of_the_typed_modules_resolves(name: str):
    """An annotation names a type that exists: with `from __future__ import annotations` and RunConfig imported
    under TYPE_CHECKING, a wrong name is never evaluated by a run."""
    module = importlib.import_module(f"moe_grpo.{name}")
    namespace = dict(vars(module))
    tree = ast.parse(Path(module.__file__).read_text())
    for node in tree.body:  # what the module imports for its annotations only, imported here
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            exec(compile(ast.Module(body=node.body, type_ignores=[]), module.__file__, "exec"), namespace)
    for obj in _annotated(module):
        typing.get_type_hints(obj, globalns=namespace)  # raises NameError naming the unresolved type
