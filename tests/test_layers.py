"""The package's import layers and cycles, as pyproject.toml's [tool.importlinter] contracts state them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_imports_keep_the_layers_and_make_no_cycle():
    """`lint-imports` keeps both contracts: no module imports from a layer above its own (an engine reaching into
    the orchestrator, the learner into checkpoint conversion), and no two modules or packages of one package import
    each other (rollout/export.py <-> rollout/vllm_engine.py, data <-> reward were such cycles)."""
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.is_file(), f"{lint} missing: install the test extra (bash tools/install.sh)"
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    report = done.stdout[done.stdout.find("Contracts"):] + done.stderr
    assert done.returncode == 0, f"lint-imports found imports against the layers or a cycle:\n{report}"
    assert "2 kept, 0 broken" in done.stdout, report
