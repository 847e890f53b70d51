"""The sizes issue 31 set for the package, kept by a test so they do not creep back: no function over 80 lines,
and driver.py the schedule alone (under 500 lines: start-up and the run's end are training_run.py and session.py)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moe_grpo"
MAX_FUNCTION_LINES = 80
MAX_DRIVER_LINES = 500


def test_no_function_in_the_package_is_over_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these along what they do:\n" + "\n".join(long)


def test_the_driver_module_is_the_schedule():
    lines = len((PACKAGE / "orchestrator" / "driver.py").read_text().splitlines())
    assert lines < MAX_DRIVER_LINES, f"orchestrator/driver.py has {lines} lines (at most {MAX_DRIVER_LINES - 1})"
