import os
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "learner"))
sys.path.insert(0, os.path.join(ROOT, "tests", "checkpoint"))  # test_convert.load_dir
# Spawned learner processes import test helpers by module name.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT, os.path.join(ROOT, "tests", "learner")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
)
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")


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




def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def engine_and_learner(tmp_path_factory):
    """One Megatron learner and one vLLM engine on the same weights, started once per test run."""
    if not _vllm_available():
        pytest.skip("vLLM is not installed (bash tools/install.sh engine)")
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
