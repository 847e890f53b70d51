"""Rollout tokens/s with routing capture divided by a bare vLLM engine's, same prompts, one run.

Two engines on the same weights: one with the worker extension capturing
routing (as training runs it), one started without the worker extension at
all (plain vLLM). They take turns, alternating which goes first, so machine
drift hits both arms. Greedy sampling without a stop token keeps the work
identical.

    .venv/bin/python tools/bench_capture.py [--prompts 16] [--prompt-len 64] [--max-tokens 64] [--rounds 4]

Last line: one JSON object; `capture_throughput_ratio` is the headline (goal >= 0.97).
"""

from __future__ import annotations

import json
import tempfile
import time

from interleave import engine_bench_parser, interleaved_medians  # tools/ is sys.path[0] when a bench runs


def main() -> None:
    args = engine_bench_parser(__doc__).parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    import numpy as np

    from moe_grpo.config import load_model_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import export_learner
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import VllmEngine

    spec = load_model_spec(args.model)
    learner = MegatronLearner(spec, config=LearnerConfig())
    model_dir = export_learner(learner, tempfile.mkdtemp(prefix="bench_capture_") + "/model")
    del learner
    kwargs = dict(max_model_len=args.prompt_len + args.max_tokens + 8, max_num_seqs=args.prompts)
    captured = VllmEngine(model_dir, spec, capture=True, **kwargs)
    bare = VllmEngine(model_dir, spec, capture=False, extension=False, **kwargs)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, spec.vocab_size, size=args.prompt_len))) for _ in range(args.prompts)]
    sampling = SamplingSettings(n=1, temperature=0.0, max_tokens=args.max_tokens, stop_token_ids=())

    def run(engine: VllmEngine) -> float:
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling)
        dt = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for g in out for c in g)
        assert all((c.routing is not None) == engine.capture for g in out for c in g)
        return tokens / dt

    a, b = interleaved_medians(lambda: run(captured), lambda: run(bare), args.rounds, warmup=1)
    captured.shutdown()
    bare.shutdown()
    print(json.dumps({
        "bench": "capture", "model": spec.name, "prompts": args.prompts, "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "rounds": args.rounds, "engine_start_seconds": round(captured.start_seconds, 1),
        "tokens_per_s_with_capture": round(a, 1), "tokens_per_s_bare_vllm": round(b, 1),
        "capture_throughput_ratio": round(a / b, 4),
    }))


if __name__ == "__main__":
    main()
