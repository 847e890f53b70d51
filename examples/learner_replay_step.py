"""One replayed policy-gradient step on the embedded default model, in ~20 lines of API.

    .venv/bin/python examples/learner_replay_step.py

Records the routing the learner chooses for a few random sequences (standing in
for a vLLM rollout's trace), scores them with group-relative advantages, and
takes one optimizer step that replays that routing.
"""

import numpy as np
import torch

from moe_grpo.algo.advantages import group_relative_advantages
from moe_grpo.config import load_model_spec
from moe_grpo.learner.batch import LearnerSequence
from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
from moe_grpo.routing.trace import RoutingTrace

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
    recorded = learner.routing(seqs, replay=False)
    for idx, row, start, end in recorded["microbatches"][0].spans:
        ids = torch.stack([recorded["free"][m][0][row, start:end] for m in range(spec.num_moe_layers)], dim=1)
        seqs[idx].routing = RoutingTrace.from_array(ids, spec.num_experts)
        print(f"sequence {idx}: trace {seqs[idx].routing.expert_ids.shape}, "
              f"{seqs[idx].routing.bytes_per_token} bytes/token")
    print("step:", learner.train_step(seqs, replay=True))
