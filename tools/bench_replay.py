"""Learner forward+backward time with routing replay divided by without, same batch, same run.

The replayed trace is the routing the learner itself chose free-running on the
same weights, so both arms route identically and do the same expert work: the
ratio isolates what replay costs (handing ids to every router, gathering
probabilities from the live scores, the applied-check bookkeeping).

    .venv/bin/python tools/bench_replay.py [--model deepseek_moe] [--batch 8] [--seq 256] [--rounds 7]
    python tools/bench_replay.py --model qwen3_moe_1b_64e --batch 8 --seq 1024   # on a CUDA GPU

On CUDA the learner defaults to bf16 weights with Megatron's distributed optimizer (fp32 main
parameters); after the interleaved arms it also times whole training steps (forward, backward,
optimizer step, replay on): `train_step_tokens_per_s`.

Last line: one JSON object; `replay_overhead_ratio` is the headline (goal <= 1.03).
"""

from __future__ import annotations

import argparse
import gc
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
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="weights' dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--optimizer", choices=("distributed", "plain"), default=None,
                    help="Megatron's distributed optimizer or the plain one (default: distributed on CUDA)")
    ap.add_argument("--packed", action="store_true", help="packed rows behind a block-diagonal mask")
    ap.add_argument("--recompute", action="store_true", help="full activation recompute (replay in recompute too)")
    ap.add_argument("--train-steps", type=int, default=3, help="timed whole training steps after the arms")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    import numpy as np
    import torch

    from moe_grpo.config import load_model_spec
    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.models.options import MegatronOptions

    cuda = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    distributed = (args.optimizer or ("distributed" if cuda else "plain")) == "distributed"
    options = MegatronOptions(params_dtype=dtype, distributed_optimizer=distributed, recompute=args.recompute)
    spec = load_model_spec(args.model).replace(max_position_embeddings=max(args.seq, 512))
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=args.batch, packed=args.packed),
                              options=options)
    params = sum(p.numel() for p in learner.module.parameters())
    rng = np.random.default_rng(0)
    seqs = [LearnerSequence(rng.integers(0, spec.vocab_size, size=args.seq), prompt_len=args.seq // 4,
                            advantage=float(rng.normal())) for _ in range(args.batch)]
    # Record the learner's own routing, then replay exactly that.
    for seq, trace in zip(seqs, learner.routing_traces(seqs, replay=False)["free"]):
        seq.routing = trace

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(replay: bool) -> float:
        learner.zero_grad()
        gc.collect()  # no collection inside a timed round (the arms allocate differently)
        gc.disable()
        try:
            sync()
            t0 = time.perf_counter()
            learner.forward_backward(seqs, replay=replay)
            sync()
            return time.perf_counter() - t0
        finally:
            gc.enable()

    t_plain, t_replay = interleaved_medians(lambda: timed(False), lambda: timed(True), args.rounds, args.warmup)
    tokens = args.batch * (args.seq - 1)
    step_seconds = []
    for _ in range(args.train_steps):
        sync()
        t0 = time.perf_counter()
        learner.train_step(seqs, replay=True)
        sync()
        step_seconds.append(time.perf_counter() - t0)
    t_step = float(np.median(step_seconds)) if step_seconds else float("nan")
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
        "train_step_seconds": round(t_step, 4),
        "train_step_tokens_per_s": round(tokens / t_step, 1),
        "params": params,
        "dtype": dtype,
        "distributed_optimizer": distributed,
        "packed": args.packed,
        "recompute": args.recompute,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
