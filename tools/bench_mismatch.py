"""Training-inference mismatch between vLLM (CPU kernels) and the Megatron learner, with and without R3.

Exports the learner's weights, samples completions with routing capture, then
measures on the same tokens: router disagreement (fraction of (token, MoE
layer) whose free-running learner top-k set differs from vLLM's) and the k3
KL(rollout || learner) on response tokens, once routing freely and once
replaying vLLM's routing. `--engine-dtype bfloat16` runs vLLM in bf16 against
the fp32 learner (the usual production gap); float32 compares equal precision.

What drives the disagreement: per MoE layer, and against the learner's router
logit gap between its k-th and (k+1)-th choice at each (token, layer): a bf16
engine perturbs the logits by about 2^-8 of their size, so flips happen where
that gap is small, and models with many experts and top-k > 1 have many such
near-ties (`--model deepseek_moe_64e`: 64 experts, top-8).

    .venv/bin/python tools/bench_mismatch.py [--model deepseek_moe_64e] [--engine-dtype bfloat16] [--prompts 16]

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
    gaps = np.concatenate([g for g in router_logit_gaps(learner, seqs, spec.top_k)])  # [positions, layers]
    flipped = np.concatenate([(np.sort(a.expert_ids, -1) != np.sort(b.expert_ids, -1)).any(-1)
                              for a, b in zip([s.routing for s in seqs], learner_traces)])
    quartiles = np.quantile(gaps, [0.25, 0.5, 0.75])
    bins = np.digitize(gaps, quartiles)
    free = learner.forward_backward(seqs, replay=False)
    learner.zero_grad()
    replayed = learner.forward_backward(seqs, replay=True)
    learner.zero_grad()
    print(json.dumps({
        "bench": "mismatch", "model": spec.name, "engine_dtype": args.engine_dtype, "learner_dtype": "float32",
        "completions": len(comps), "response_tokens": int(free["tokens"]),
        "num_experts": spec.num_experts, "top_k": spec.top_k, "moe_layers": spec.num_moe_layers,
        "router_disagreement_without_replay": round(1 - agree["set_agreement"], 6),
        "router_disagreement_per_layer": [round(1 - a, 6) for a in agree["set_agreement_per_layer"]],
        "logit_gap_median": float(np.median(gaps)),
        "logit_gap_median_where_flipped": float(np.median(gaps[flipped])) if flipped.any() else None,
        "logit_gap_quartiles": [float(q) for q in quartiles],
        "disagreement_by_gap_quartile": [round(float(flipped[bins == i].mean()), 6) for i in range(4)],
        "kl_k3_without_replay": free["train/rollout_kl"], "kl_k3_with_replay": replayed["train/rollout_kl"],
        "replay_applied": replayed["replay/applied"],
    }))


def router_logit_gaps(learner, seqs, top_k: int) -> list:
    """Per sequence, `[positions, moe_layers]`: the learner's router logit of its k-th choice minus that of its
    (k+1)-th (free routing, the current weights): how far each decision is from a tie.

    Captured by wrapping each router's `gating` (megatron-core 0.16.1's TopKRouter: the logits before the
    score function), one sequence per forward so the logits' rows are that sequence's positions in order."""
    import numpy as np

    routers = [layer.mlp.router for layer in learner.module.decoder.layers if hasattr(layer.mlp, "router")]
    captured: dict[int, object] = {}

    def wrap(index: int, gating):
        def gating_recorded(x):
            logits = gating(x)
            captured[index] = logits.detach().float().reshape(-1, logits.shape[-1]).cpu()
            return logits
        return gating_recorded

    for i, r in enumerate(routers):
        r.gating = wrap(i, r.gating)
    try:
        out = []
        for s in seqs:
            captured.clear()
            learner.logprobs([s], replay=False)
            n = len(s.tokens) - 1
            top = [captured[i][:n].topk(top_k + 1, dim=-1).values for i in range(len(routers))]
            out.append(np.stack([(t[:, top_k - 1] - t[:, top_k]).numpy() for t in top], axis=1))
        return out
    finally:
        for r in routers:
            del r.gating  # the class's method again


if __name__ == "__main__":
    main()
