"""Reading the root cause of a vLLM failure back from the log its processes write (`rollout/engine_log.py`).

What a user would notice: an engine that cannot start stops the run naming why (a KV cache larger than the host's
memory, say), not "Engine core initialization failed. See root cause above." with the cause 100 lines up the
console or only in engine.log."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from moe_grpo.rollout.engine_log import log_size, root_cause, vllm_log_file

FAILED_START = """\
2026-11-28 12:54:02,480 INFO [2112 default_loader.py:501] Loading weights took 0.01 seconds
2026-11-28 12:54:03,246 ERROR [2112 multiproc_executor.py:1063] WorkerProc hit an exception.
Traceback (most recent call last):
  File "/v/vllm/v1/worker/cpu_worker.py", line 219, in determine_available_memory
    raise ValueError(
ValueError: Available memory on node 0 (14.35/16.46 GiB) on kv cache allocation is less than requested memory for kv (200.0 GiB).
2026-11-28 12:54:03,247 ERROR [2107 core.py:1510] EngineCore failed to start.
Traceback (most recent call last):
  File "/v/vllm/v1/executor/multiproc_executor.py", line 444, in get_response
    raise RuntimeError(
RuntimeError: Worker failed with error 'Available memory on node 0', please check the stack trace above for the root cause
"""


def test_the_first_error_after_the_engines_start_is_its_cause(tmp_path):
    log = tmp_path / "engine.log"
    earlier = "2026-11-28 12:00:00,000 ERROR [1 core.py:1] an earlier engine failed\nOSError: [Errno 2] gone\n"
    log.write_text(earlier)
    since = log_size(str(log))
    with open(log, "a") as f:
        f.write(FAILED_START)
    assert root_cause(str(log), since) == ("ValueError: Available memory on node 0 (14.35/16.46 GiB) on kv cache "
                                           "allocation is less than requested memory for kv (200.0 GiB).")
    assert root_cause(str(log), 0) == "OSError: [Errno 2] gone", "from where the file ended when the start began"
    assert root_cause(str(log), log_size(str(log))) is None, "nothing logged since"
    assert root_cause(str(tmp_path / "missing.log"), 0) is None and root_cause(None, 0) is None
    quiet = tmp_path / "quiet.log"
    quiet.write_text("2026-11-28 12:00:00,000 INFO [1 a.py:1] loaded\nValueError: a line, not in an error record\n")
    assert root_cause(str(quiet), 0) is None, "only what follows an ERROR record"
    unrelated = tmp_path / "unrelated.log"
    unrelated.write_text("2026-11-28 12:00:00,000 ERROR [1 a.py:1] a record without a traceback\n"
                         "2026-11-28 12:00:01,000 WARNING [1 b.py:1] a warning with one\nKeyError: 'x' is ignored\n"
                         "2026-11-28 12:00:02,000 ERROR [2 c.py:1] the failure\nTraceback (most recent call last):\n"
                         "AssertionError\n")
    assert root_cause(str(unrelated), 0) == "AssertionError", "the exception of an ERROR record, bare or not"
    dotted = tmp_path / "oom.log"
    dotted.write_text("2026-11-28 12:00:00,000 ERROR [1 w.py:1] failed\nTraceback (most recent call last):\n"
                      "torch.OutOfMemoryError: CUDA out of memory. " + "x" * 1000 + "\n")
    assert root_cause(str(dotted), 0).startswith("torch.OutOfMemoryError: CUDA out of memory.")
    assert len(root_cause(str(dotted), 0)) < 700


def test_the_log_file_is_the_one_the_runs_logging_config_names(tmp_path, monkeypatch):
    from moe_grpo.orchestrator.logs import vllm_logging_config

    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(vllm_logging_config(tmp_path)))
    assert vllm_log_file() == str(tmp_path.resolve() / "engine.log")
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH")
    assert vllm_log_file() is None
    (tmp_path / "bad.json").write_text("[1, 2]")
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "bad.json"))
    assert vllm_log_file() is None
    (tmp_path / "console.json").write_text(json.dumps({"handlers": {"console": {"class": "logging.StreamHandler"}}}))
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "console.json"))
    assert vllm_log_file() is None


@pytest.mark.vllm
def test_an_engine_that_cannot_start_names_the_cause_and_leaves_nothing_in_dev_shm(engine_and_learner, tmp_path):
    """A KV cache of 100,000 GiB on this host: vLLM's worker refuses it, and the engine's error carries the worker's
    reason (before: "Engine core initialization failed. See root cause above."); what its processes made in /dev/shm
    is removed. In a process of its own, as a run's
    engine actor is: vLLM reads its logging config once, when it is imported."""
    engine, _ = engine_and_learner
    script = textwrap.dedent(f"""
        from layout_scenarios import tiny_spec
        from moe_grpo.orchestrator.logs import quiet_vllm
        quiet_vllm({str(tmp_path)!r})
        from moe_grpo.rollout.engine_error import EngineError
        from moe_grpo.rollout.engine_processes import shm_snapshot
        from moe_grpo.rollout.vllm_engine import VllmEngine
        before = shm_snapshot()
        try:
            VllmEngine({engine.model_dir!r}, tiny_spec(), max_model_len=256, kv_cache_gib=100000, name="too_big")
        except EngineError as e:
            print("ENGINE ERROR:", e)
        print("LEFT IN /dev/shm:", sorted(n for n, i in shm_snapshot().items() if before.get(n) != i))
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.environ["PYTHONPATH"]})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ENGINE ERROR:")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-4000:]
    assert "engine too_big: vLLM failed to start" in line and "ValueError: " in line and "100000" in line, line
    assert f"in {tmp_path.resolve() / 'engine.log'}; the engine's own error: " in line, line
    # vLLM's ring buffers of the failed start (~400 MiB) were left in /dev/shm: nothing had recorded its processes
    assert "LEFT IN /dev/shm: []" in out.stdout, out.stdout[-2000:]
