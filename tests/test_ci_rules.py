"""The suite's own rule for vLLM: engine tests skip where vLLM is missing, but fail under CI.

Each case runs pytest in a subprocess with this suite's conftest on a tiny test
file, with a fake `vllm` package first on the path, so the rule is tested
against a missing vLLM without uninstalling the real one.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SUBPROCESS = pytest.mark.slow  # each test that calls _run runs pytest in a subprocess

TINY = '''
import pytest

@pytest.mark.vllm
def test_marked():
    pass

def test_through_the_engine_fixture(engine_and_learner):
    pass
'''


def _run(tmp_path: Path, vllm_init: str, ci: str | None, *args: str) -> subprocess.CompletedProcess:
    """pytest on TINY with tests/conftest.py as a plugin and `vllm` being the fake whose __init__ is `vllm_init`."""
    fake = tmp_path / "fake_site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(vllm_init)
    (tmp_path / "test_tiny.py").write_text(TINY)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(TESTS), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "conftest", "-p", "no:cacheprovider",
                           "-o", "markers=vllm: needs vLLM", *args, str(tmp_path / "test_tiny.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


MISSING = 'raise ImportError("No module named vllm (fake, for the test)")\n'


@SUBPROCESS
def test_without_ci_engine_tests_skip_when_vllm_is_missing(tmp_path):
    out = _run(tmp_path, MISSING, ci=None)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "2 skipped" in text and "vLLM is not installed (ImportError: No module named vllm (fake" in text, text


@SUBPROCESS
def test_under_ci_engine_tests_fail_when_vllm_is_missing(tmp_path):
    """CI=true in the subprocess; the other spellings of CI are `in_ci`'s (the unit test below), which the rule
    reads (until 2026-11-27 each spelling was a pytest subprocess of its own, ~3.5 s each: issue 30)."""
    ci = "true"
    out = _run(tmp_path, MISSING, ci=ci)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "2 error" in text and "skipped" not in text, text
    assert f"vLLM is required when CI='{ci}'" in text and "ImportError: No module named vllm (fake" in text, text


@SUBPROCESS
def test_under_ci_a_marked_test_runs_when_vllm_imports(tmp_path):
    """The control: the rule fails only a missing vLLM (here a fake that imports), not every marked test under CI."""
    out = _run(tmp_path, "", "true", "-k", "test_marked")  # the fixture would start a real engine
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "1 passed" in text, text
    assert "PASSED" in text and "test_marked" in text and "vLLM is required" not in text, text


@pytest.mark.parametrize("value,ci", [("true", True), ("TRUE", True), ("1", True), ("yes", True), (" true\n", True),
                                      ("false", False), ("0", False), ("", False), ("no", False)])
def test_ci_is_true_1_or_yes_in_any_case(monkeypatch, value, ci):
    """What the rule above takes for CI (tests/ci_env.py `in_ci`, which tests/conftest.py reads): a CI=false run
    skips engine tests as a developer's does."""
    from ci_env import in_ci

    monkeypatch.setenv("CI", value)
    assert in_ci() is ci


@SUBPROCESS
def test_engine_tests_are_left_out_of_the_inner_loop(tmp_path):
    """`pytest -m "not slow"` (the inner loop) leaves out a test marked `vllm` even when it does not say `slow`: it
    starts an engine (tests/conftest.py SLOW_BY_MARKER); an unmarked test stays in."""
    out = _run(tmp_path, "", None, "-m", "not slow", "--collect-only")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "test_tiny.py::test_through_the_engine_fixture" in text and "test_marked" not in text, text
    assert "1 deselected" in text, text
