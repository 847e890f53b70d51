"""A learner rank that takes its time: engines run ahead, so staleness is what the buffer must bound."""

import time

from moe_grpo.orchestrator.learner_actor import LearnerWorker


class SlowLearner(LearnerWorker):
    def train(self, seqs, policy_version, replay):
        time.sleep(1.5)
        return super().train(seqs, policy_version, replay)
