"""The README's main command, end to end: learner, rollout with capture, replayed step, weight sync."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.vllm
@pytest.mark.slow
def test_main_job_rolls_out_steps_syncs_and_says_it_stops_there():
    pytest.importorskip("vllm")
    out = subprocess.run([sys.executable, "-m", "moe_grpo.train", "model=deepseek_moe"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "replay/applied=1.00" in text
    gap = re.search(r"\[sync\] version 1: .* max \|logprob\(vLLM\) - logprob\(learner\)\| = ([0-9.e+-]+)", text)
    assert gap and float(gap.group(1)) < 1e-4, text[-3000:]
    assert "the asynchronous GRPO loop are not built yet" in text
