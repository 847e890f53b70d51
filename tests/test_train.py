"""The README's main command, end to end, shortened: it trains, writes the run record, and reads cleanly."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.vllm
@pytest.mark.slow
def test_main_job_trains_writes_the_run_record_and_prints_no_traceback(tmp_path):
    cmd = [sys.executable, "-m", "moe_grpo.train", "model=deepseek_moe", "steps=4", "warm_start_steps=2",
           "eval_every=2", "algo.prompts_per_step=4", "algo.group_size=4", f"hydra.run.dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip() and "train:" not in ln]
    assert len(lines) < 60, "the console should stay readable:\n" + "\n".join(lines)
    assert "held-out reward" in text and "4 steps in" in text
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # values a broken run gets wrong (a missing key or unapplied replay already fails the run)
        assert r["policy_version"] == r["step"] and r["staleness/max"] <= 1, r
        assert 0 <= r["reward/mean"] <= 1 and 0 <= r["eval/reward/mean"] <= 1
        assert r["sync/bytes"] > 0 and r["throughput/rollout_tokens_per_s"] >= 0
        assert (r["grad_norm"] == 0) if r["reward/std"] == 0 else (r["grad_norm"] >= 0), r
        assert r["faults/engine_restarts"] == r["faults/requests_lost"] == r["faults/steps_skipped"] == 0
    assert [r["eval/step"] for r in rows] == [0, 2, 2, 4]
    # async: a step may train on groups sampled during an earlier one, but the engines generated over the run
    assert sum(r["throughput/rollout_tokens_per_s"] for r in rows) > 0
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000004", "a checkpoint at the end"
    assert (tmp_path / "config.yaml").read_text().count("prompts_per_step: 4") == 1
    assert "INFO" in (tmp_path / "engine.log").read_text(), "vLLM's full log goes to the run directory"
    assert (tmp_path / "metrics.png").exists()
