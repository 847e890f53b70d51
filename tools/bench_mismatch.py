"""Training-inference mismatch between vLLM (CPU kernels) and the Megatron learner, with and without R3.

Exports the learner's weights, samples completions with routing capture, then
measures on the same tokens: router disagreement (fraction of (token, MoE
layer) whose free-running learner top-k set differs from vLLM's) and the k3
KL(rollout || learner) on response tokens, once routing freely and once
replaying vLLM's routing. `--engine-dtype bfloat16` runs vLLM in bf16 against
the fp32 learner (the usual production gap); float32 compares equal precision.

    .venv/bin/python tools/bench_mismatch.py [--engine-dtype bfloat16] [--prompts 16] [--max-tokens 48]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek_moe")
    ap.add_argument("--engine-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    import numpy as np

    from moe_grpo.config import load_model_spec
    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import export_learner
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import VllmEngine
    from moe_grpo.routing.metrics import agreement

    spec = load_model_spec(args.model)
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=args.prompts * 2))
    model_dir = export_learner(learner, tempfile.mkdtemp(prefix="bench_mismatch_") + "/model")
    engine = VllmEngine(model_dir, spec, max_model_len=256, max_num_seqs=32, dtype=args.engine_dtype)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, spec.vocab_size, size=int(rng.integers(8, 64))))) for _ in range(args.prompts)]
    comps = [c for g in engine.generate(prompts, SamplingSettings(n=2, max_tokens=args.max_tokens)) for c in g]
    engine.shutdown()
    seqs = [LearnerSequence(np.concatenate([c.prompt_ids, c.token_ids]), prompt_len=len(c.prompt_ids),
                            routing=c.routing, old_logprobs=c.logprobs) for c in comps]
    learner_traces = learner.routing_traces(seqs, replay=False)["free"]
    agree = agreement([s.routing for s in seqs], learner_traces)
    free = learner.forward_backward(seqs, replay=False)
    learner.zero_grad()
    replayed = learner.forward_backward(seqs, replay=True)
    learner.zero_grad()
    print(json.dumps({
        "bench": "mismatch", "model": spec.name, "engine_dtype": args.engine_dtype, "learner_dtype": "float32",
        "completions": len(comps), "response_tokens": int(free["tokens"]),
        "router_disagreement_without_replay": round(1 - agree["set_agreement"], 6),
        "kl_k3_without_replay": free["train/rollout_kl"], "kl_k3_with_replay": replayed["train/rollout_kl"],
        "replay_applied": replayed["replay/applied"],
    }))


if __name__ == "__main__":
    main()
