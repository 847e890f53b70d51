"""`python -m moe_grpo.evaluate` on a run's exported policy reproduces the run's last held-out score.

The run (tests/conftest.py `main_job`) publishes every 2 steps and stops at step 3: its final evaluation must still
be of step 3's weights (the last step is published and the evaluation waits until the engine serves it), which are
the exported policy's."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.vllm
@pytest.mark.slow
def test_evaluating_a_runs_policy_gives_its_last_held_out_score(main_job, tmp_path):
    run_dir, out = main_job  # tests/conftest.py: the main job, 3 steps, publishing every 2 and after the last
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    record = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [(r["eval/step"], r["eval/policy_version"]) for r in record] == [(0, 0), (2, 2), (3, 3)]
    last = record[-1]
    assert 0 < last["eval/reward/mean"] < 1, "a score that a wrong policy, tokenizer or held-out set would change"
    eval_dir = tmp_path / "eval"

    evaluate = [sys.executable, "-m", "moe_grpo.evaluate", f"policy={run_dir / 'policy'}", "task.eval_size=16",
                "samples=4", "pass_k=[1,4]", f"output={eval_dir}", f"hydra.run.dir={tmp_path / 'hydra'}",
                "rollout.request_timeout_s=600"]  # the engine's start gets as long (loaded machines)
    out = subprocess.run(evaluate, cwd=ROOT, capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "Traceback" not in text, text[-4000:]
    summary = json.loads((eval_dir / "evaluation.json").read_text())
    assert summary["rows"] == 16 and summary["samples"] == 4
    assert summary["greedy"]["reward_mean"] == pytest.approx(last["eval/reward/mean"], abs=1e-9), (summary, last)
    rows = [json.loads(line) for line in open(eval_dir / "evaluation_rows.jsonl")]
    assert len(rows) == 16 and all(len(r["samples"]) == 4 for r in rows)
    assert summary["greedy"]["accuracy"] == pytest.approx(sum(r["greedy_reward"] == 1.0 for r in rows) / 16)
    assert summary["pass@1"] == pytest.approx(sum(r["correct"] for r in rows) / 64)
    assert 0 <= summary["pass@1"] <= summary["pass@4"] <= 1
    assert f"greedy accuracy {summary['greedy']['accuracy']:.3f}" in text
