"""`run_distributed`: ranks start from a process that already imported torch and megatron-core, yet see the caller's
environment and report their failures as a spawned process would."""

import os
import sys

import pytest

from moe_grpo.learner import spawn
from moe_grpo.learner.spawn import DistributedRunError, run_distributed

pytestmark = pytest.mark.multiprocess


def _modules_and_env(names: list[str]) -> dict:
    """What a rank finds when its function starts: which heavy modules were already imported, and the environment."""
    return {"preloaded": [m for m in spawn.PRELOADED_MODULES if m in sys.modules],
            "env": {n: os.environ.get(n) for n in names}}


def _exit_hard(code: int) -> None:
    os._exit(code)


def test_ranks_start_with_torch_and_megatron_already_imported():
    """Each rank used to import torch and megatron-core itself (a spawned interpreter: ~6 s per group on 2 cores,
    paid by every multi-process test and by every verification of the convert tools); now they are imported once
    per calling process, in the server ranks are forked from."""
    first, second = run_distributed(_modules_and_env, 2, [])
    assert first["preloaded"] == second["preloaded"] == list(spawn.preloaded_here())
    assert "torch" in first["preloaded"]
    if not spawn.cuda_host():  # on a CUDA host only torch is preloaded (see PRELOADED_MODULES)
        assert "megatron.core.models.gpt" in first["preloaded"]


def test_a_spawned_group_imports_only_what_its_ranks_import():
    """`start_method='spawn'` (a run's driver converting its checkpoint once): fresh interpreters, no process server
    left beside the driver; the ranks find only what `_entry` imports."""
    first, = run_distributed(_modules_and_env, 1, [], start_method="spawn")
    assert "torch" in first["preloaded"] and "megatron.core.models.gpt" not in first["preloaded"]
    with pytest.raises(ValueError, match="start_method='fork'"):
        run_distributed(_modules_and_env, 1, [], start_method="fork")


def test_ranks_see_the_callers_environment_as_it_is_when_they_start(monkeypatch):
    """The process server started with an earlier environment; a rank still sees the caller's at its own start
    (as a spawned one does): a variable set, changed or removed since is as the caller has it now."""
    monkeypatch.setenv("MOE_GRPO_SPAWN_TEST_KEPT", "before")
    monkeypatch.setenv("MOE_GRPO_SPAWN_TEST_GONE", "set")
    run_distributed(_modules_and_env, 1, [])  # the server is running from here on
    monkeypatch.setenv("MOE_GRPO_SPAWN_TEST_KEPT", "after")
    monkeypatch.setenv("MOE_GRPO_SPAWN_TEST_NEW", "new")
    monkeypatch.delenv("MOE_GRPO_SPAWN_TEST_GONE")
    names = ["MOE_GRPO_SPAWN_TEST_KEPT", "MOE_GRPO_SPAWN_TEST_NEW", "MOE_GRPO_SPAWN_TEST_GONE", "RANK", "WORLD_SIZE"]
    envs = [r["env"] for r in run_distributed(_modules_and_env, 2, names, env={"MOE_GRPO_SPAWN_TEST_NEW": "given"})]
    assert envs == [{"MOE_GRPO_SPAWN_TEST_KEPT": "after", "MOE_GRPO_SPAWN_TEST_NEW": "given",
                     "MOE_GRPO_SPAWN_TEST_GONE": None, "RANK": str(r), "WORLD_SIZE": "2"} for r in range(2)]


def test_a_rank_that_exits_is_named_with_its_exit_code():
    with pytest.raises(DistributedRunError, match=r"rank 0: died \(exit code 3\)"):
        run_distributed(_exit_hard, 1, 3)


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


def test_a_group_stopped_from_another_thread_is_killed_at_once():
    """A run that ends while its checkpoint converts on a thread (checkpoint/hf_init.py) sets `stop`: the ranks
    are killed and the call raises, instead of the interpreter's exit waiting for non-daemon ranks to finish."""
    import threading
    import time

    import psutil

    run_distributed(_sleep, 1, 0.0)  # the process server (and its resource tracker) up, as they stay
    before = {p.pid for p in psutil.Process().children()}
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError, match="_sleep on 1 processes stopped before it finished"):
        run_distributed(_sleep, 1, 120.0, stop=stop)
    assert time.monotonic() - t0 < 30
    assert not [p for p in psutil.Process().children() if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
