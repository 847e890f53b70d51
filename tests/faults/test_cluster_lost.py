"""The Ray cluster's GCS dying under a run: the run checkpoints, cleans up and stops in one line before Ray ends it.

Before 2026-11-28 the run trained on (its actors answer without the GCS) until Ray ended the driver from inside 60 s
later ("Failed to connect to GCS within 60 seconds"): exit 1, no checkpoint (every step since the last periodic one
lost), no cleanup, no `[moe_grpo]` line, and the run's own Ray agents alive two minutes more."""

import time

import psutil
import pytest

from moe_grpo.orchestrator.run_checkpoint import complete_checkpoints
from runs import Run, shm_entries, shm_left_behind

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiprocess]


def test_a_dead_gcs_stops_the_run_at_a_checkpoint_in_one_line_before_ray_ends_it(tmp_path):
    shm_before = shm_entries()
    # Its own Ray: the GCS killed is the run's, a child of the driver (the session's cluster serves other tests).
    run = Run(tmp_path / "run", "steps=200", "mode=async", "checkpoint.every=0", own_ray=True)
    try:
        run.wait_step(3)
        gcs = [p for p in psutil.Process(run.proc.pid).children(recursive=True) if p.name() == "gcs_server"]
        assert len(gcs) == 1, [p.name() for p in psutil.Process(run.proc.pid).children(recursive=True)]
        t0 = time.monotonic()
        gcs[0].kill()
        code = run.finish(120)
        took = time.monotonic() - t0
    except BaseException:
        run.kill()
        raise
    last = [line for line in run.output.splitlines() if line.strip()][-1]
    assert code == 1 and last.startswith("[moe_grpo] stopped: the Ray cluster's GCS at 127.0.0.1:"), run.output[-3000:]
    assert took < 45, f"{took:.0f} s: Ray ends the driver 60 s after its GCS went"
    assert "Failed to connect to GCS" not in run.output, "Ray ended the run, not the run itself"
    checkpoints = complete_checkpoints(run.run_dir)
    steps = [int(r["step"]) for r in run.rows()]
    assert [p.name for p in checkpoints] == [f"step_{steps[-1]:06d}"], (checkpoints, steps)
    assert f"checkpoint {checkpoints[0]}: resume=true continues from it" in last
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= 3
    assert not run.leftovers(), run.leftovers()
    assert run.shm_left() == [] and shm_left_behind(shm_before) == set()
