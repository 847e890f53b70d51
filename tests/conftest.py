import functools
import os
import subprocess
import sys
import warnings

import pytest

from ci_env import in_ci

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "learner"))
sys.path.insert(0, os.path.join(ROOT, "tests", "checkpoint"))  # test_convert.load_dir
sys.path.insert(0, os.path.join(ROOT, "tests", "sync"))  # publishing.publish_version
# Spawned learner processes import test helpers by module name.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT, os.path.join(ROOT, "tests", "learner")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
)
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")


SLOW_BY_MARKER = ("vllm", "multiprocess")
"""Tests with these markers start a vLLM engine or torch.distributed processes: they are `slow` whether or not they
say so, so `pytest -m "not slow"` (the inner loop, README "Contributing") starts neither."""


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("slow") is None and any(item.get_closest_marker(m) for m in SLOW_BY_MARKER):
            item.add_marker(pytest.mark.slow)


@functools.lru_cache(maxsize=1)
def _vllm_import_error() -> str | None:
    """Why `import vllm` fails here, or None if it works (checked once per run)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install failing at import time
        return f"{type(e).__name__}: {e}"
    return None


def require_vllm() -> None:
    """The one rule for tests that need vLLM: without it they skip, except under CI, where they fail.

    Under CI a skipped engine test would let the suite pass without ever starting
    an engine, so a missing or broken vLLM is a failure there."""
    error = _vllm_import_error()
    if error is None:
        return
    if in_ci():
        pytest.fail(f"vLLM is required when CI={os.environ.get('CI')!r} (the engine tests must run, not skip), "
                    f"but `import vllm` failed: {error}; install it with `bash tools/install.sh engine`",
                    pytrace=False)
    pytest.skip(f"vLLM is not installed ({error}; bash tools/install.sh engine)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Tests marked `vllm` go through `require_vllm` before any of their fixtures start."""
    if item.get_closest_marker("vllm") is not None:
        require_vllm()


@pytest.fixture(scope="session")
def engine_and_learner(tmp_path_factory):
    """One Megatron learner and one vLLM engine on the same weights, started once per test run."""
    require_vllm()
    from layout_scenarios import tiny_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import export_learner
    from moe_grpo.rollout.vllm_engine import VllmEngine

    spec = tiny_spec()  # the embedded default with 4 layers, so PP=2 splits it evenly
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=4, lr=1e-2))
    model_dir = export_learner(learner, tmp_path_factory.mktemp("engine") / "model")
    # Small batched-token budget: long prompts are prefilled in chunks, which the capture must stitch.
    engine = VllmEngine(model_dir, spec, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)
    yield engine, learner
    engine.shutdown()


@pytest.fixture(autouse=True)
def _engine_left_as_found(request):
    """The session engine (`engine_and_learner`) is shared by the engine and sync tests: after each test that used
    it, it must be as the next one expects (alive and healthy, no request in flight, no routing buffer held, capture
    on, no adapter), or that test fails naming what it left. (Which weights it serves is each module's to hand back:
    tests/sync/test_sync.py's `synced` reloads the learner's.)"""
    yield
    if "engine_and_learner" not in request.fixturenames:
        return
    engine, _ = request.getfixturevalue("engine_and_learner")
    left = {"not alive": not engine.alive(), "closing": engine.closing, "broken": getattr(engine, "broken", None),
            "requests in flight": engine.in_flight(), "routing buffers": engine.num_routing_buffers(),
            "capture off": not engine.capture, "adapter": engine.lora is not None}
    left = {k: v for k, v in left.items() if v}
    if left:
        pytest.fail(f"the shared engine was left changed by this test: {left}", pytrace=False)


@pytest.fixture(scope="session")
def main_job(tmp_path_factory):
    """README command 1, shortened, as a user runs it (`python -m moe_grpo.train`), once per test run: the main-job
    test reads its console and record, the evaluation test scores its exported policy. It publishes every 2 steps
    and stops at step 3, so the last step is published only because it is the last (the final evaluation and the
    exported policy must still be step 3's weights)."""
    require_vllm()
    run_dir = tmp_path_factory.mktemp("main_job")
    cmd = [sys.executable, "-m", "moe_grpo.train", "model=deepseek_moe", "steps=3", "warm_start_steps=50",
           "eval_every=2", "algo.prompts_per_step=4", "algo.group_size=4", "algo.sync_every=2",
           "algo.max_staleness=2", "task.eval_size=16", f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    return run_dir, out


@pytest.fixture(scope="session")
def session_ray_address():
    """The address of the test session's one Ray cluster (tests/ray_session.py: started on first use the way a run
    starts its own, stopped and checked gone at the session's end). A whole run that does not test Ray's own start
    and stop joins it: `cluster.ray_address=<this>` (`train(run)` in-process: this process is set up to join it;
    tests/faults/runs.py `Run` joins it by default)."""
    import ray_session

    yield from ray_session.session_ray_address_fixture()


@pytest.hookimpl(trylast=True)  # after the fixtures' teardown, whose check of what is left fails the session
def pytest_sessionfinish(session, exitstatus):
    """The session cluster ends with the session even when only `Run` started it (no fixture to finalize)."""
    import ray_session

    ray_session.stop()


@pytest.fixture(scope="session")
def on_session_ray():
    """`train(on_session_ray(run), run_dir)`: the run (a `RunConfig`) joining the session's Ray cluster, started on
    first use (as it is with MOE_GRPO_TEST_SESSION_RAY=0: Ray of the run's own)."""
    import ray_session

    return ray_session.joining


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """({family: checkpoint directory}, root): one small transformers-written checkpoint per family, its Megatron
    conversion cached under `root / "cache"` for every run from it (test_hf_runs, test_lora_runs), as a user's second
    run from a checkpoint reuses the first one's: the first run to start from a family converts it."""
    from hf_fixtures import make_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {kind: make_checkpoint(kind, root / kind) for kind in ("qwen3_moe", "deepseek_v3")}, root
