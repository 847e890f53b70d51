import os

import pytest


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
    from moe_grpo.config import load_model_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import export_learner
    from moe_grpo.rollout.vllm_engine import VllmEngine

    spec = load_model_spec("deepseek_moe")
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=4, lr=1e-2))
    model_dir = export_learner(learner, tmp_path_factory.mktemp("engine") / "model")
    # Small batched-token budget: long prompts are prefilled in chunks, which the capture must stitch.
    engine = VllmEngine(model_dir, spec, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64)
    yield engine, learner
    engine.shutdown()
