"""Learner forward+backward time with routing replay divided by without, same batch, same run.

The replayed trace is the routing the learner itself chose free-running on the
same weights, so both arms route identically and do the same expert work: the
ratio isolates what replay costs (handing ids to every router, gathering
probabilities from the live scores, the applied-check bookkeeping).

    .venv/bin/python tools/bench_replay.py [--model deepseek_moe] [--batch 8] [--seq 256] [--rounds 7]

Last line: one JSON object; `replay_overhead_ratio` is the headline (goal <= 1.03).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

from interleave import interleaved_medians  # tools/ is sys.path[0] when a bench runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek_moe", help="conf/model/<name>.yaml")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per arm (interleaved)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds per arm")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    import numpy as np
    import torch

    from moe_grpo.config import load_model_spec
    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner

    spec = load_model_spec(args.model).replace(max_position_embeddings=max(args.seq, 512))
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=args.batch))
    rng = np.random.default_rng(0)
    seqs = [LearnerSequence(rng.integers(0, spec.vocab_size, size=args.seq), prompt_len=args.seq // 4,
                            advantage=float(rng.normal())) for _ in range(args.batch)]
    # Record the learner's own routing, then replay exactly that.
    for seq, trace in zip(seqs, learner.routing_traces(seqs, replay=False)["free"]):
        seq.routing = trace

    def timed(replay: bool) -> float:
        learner.zero_grad()
        t0 = time.perf_counter()
        learner.forward_backward(seqs, replay=replay)
        return time.perf_counter() - t0

    t_plain, t_replay = interleaved_medians(lambda: timed(False), lambda: timed(True), args.rounds, args.warmup)
    tokens = args.batch * (args.seq - 1)
    result = {
        "bench": "replay",
        "model": spec.name,
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "fwd_bwd_seconds_without_replay": round(t_plain, 4),
        "fwd_bwd_seconds_with_replay": round(t_replay, 4),
        "tokens_per_s_without_replay": round(tokens / t_plain, 1),
        "tokens_per_s_with_replay": round(tokens / t_replay, 1),
        "replay_overhead_ratio": round(t_replay / t_plain, 4),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
