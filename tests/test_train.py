"""The README's main command, end to end, shortened: it trains, writes the run record, and reads cleanly."""

import json

import pytest


@pytest.mark.vllm
@pytest.mark.slow
def test_main_job_trains_writes_the_run_record_and_prints_no_traceback(main_job):
    run_dir, out = main_job  # tests/conftest.py: 3 steps, publishing every 2 and after the last
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    # The run ends its engine by killing it (engine_actor.EngineWorker.shutdown): vLLM must not report that as a crash.
    assert "exited unexpectedly" not in text, text[-4000:]
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip() and "train:" not in ln]
    assert len(lines) < 60, "the console should stay readable:\n" + "\n".join(lines)
    # Library chatter stays in engine.log: vLLM's import-time warnings (Triton), its checkpoint-loading bars, Ray's
    # token-authentication notice. (One C++ warning of vLLM's CPU worker, NUMA binding, bypasses Python's logging.)
    chatter = [ln for ln in lines if "(EngineWorker" in ln or "(LearnerWorker" in ln or "authentication" in ln]
    assert len(chatter) <= 1 and all("NUMA" in ln for ln in chatter), "\n".join(chatter)
    assert "held-out reward" in text and "3 steps in" in text
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # values a broken run gets wrong (a missing key or unapplied replay already fails the run)
        assert 0 <= r["reward/mean"] <= 1 and 0 <= r["eval/reward/mean"] <= 1
        assert r["sync/bytes"] > 0 and r["throughput/rollout_tokens_per_s"] >= 0
        assert (r["grad_norm"] == 0) if r["reward/std"] == 0 else (r["grad_norm"] >= 0), r
        assert r["faults/engine_restarts"] == r["faults/requests_lost"] == r["faults/steps_skipped"] == 0
    # Only versions 0, 2 and 3 are ever published (sync_every=2, and the last step), so the staleness of what each
    # step trained is fixed: step 1 trains tokens of version 0 (0 behind), step 2 only tokens of version 0 (1 behind:
    # version 1 was never served), step 3 tokens of version 0 or 2 (2 or 0 behind). A wrong version stamp on the
    # engine's tokens, or a staleness counted against the wrong version, breaks this pattern.
    assert [r["staleness/max"] for r in rows][:2] == [0, 1] and rows[1]["staleness/mean"] == 1, rows
    assert rows[2]["staleness/max"] in (0, 2), rows[2]
    # Each evaluation is of the newest published version (0, 2, then 3: the last step is published too).
    assert [(r["eval/step"], r["eval/policy_version"]) for r in rows] == [(0, 0), (2, 2), (3, 3)]
    # async: a step may train on groups sampled during an earlier one, but the engines generated over the run
    assert sum(r["throughput/rollout_tokens_per_s"] for r in rows) > 0
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000003", "a checkpoint at the end"
    assert (run_dir / "config.yaml").read_text().count("prompts_per_step: 4") == 1
    assert "INFO" in (run_dir / "engine.log").read_text(), "vLLM's full log goes to the run directory"
    assert (run_dir / "metrics.png").exists()
    assert (run_dir / "policy" / "config.json").exists(), "the final policy is exported"
