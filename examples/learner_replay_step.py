"""One replayed policy-gradient step on the embedded default model, in ~20 lines of API.

    .venv/bin/python examples/learner_replay_step.py

Records the routing the learner chooses for a few random sequences (standing in
for a vLLM rollout's trace), scores them with group-relative advantages, and
takes one optimizer step that replays that routing.
"""

import numpy as np

from moe_grpo.algo.advantages import group_relative_advantages
from moe_grpo.config import load_model_spec
from moe_grpo.learner.batch import LearnerSequence
from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner

if __name__ == "__main__":
    spec = load_model_spec("deepseek_moe")
    learner = MegatronLearner(spec, config=LearnerConfig(lr=1e-3, micro_batch_size=4))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, spec.vocab_size, size=8)
    seqs = [LearnerSequence(np.concatenate([prompt, rng.integers(0, spec.vocab_size, size=8)]), prompt_len=8)
            for _ in range(4)]
    rewards = rng.random((1, 4))  # one prompt, four completions
    for seq, adv in zip(seqs, group_relative_advantages(rewards)[0]):
        seq.advantage = float(adv)
    for idx, trace in enumerate(learner.routing_traces(seqs, replay=False)["free"]):
        seqs[idx].routing = trace
        print(f"sequence {idx}: trace {trace.expert_ids.shape}, {trace.bytes_per_token} bytes/token")
    print("step:", learner.train_step(seqs, replay=True))
