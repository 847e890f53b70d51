"""Seconds from `VllmEngine(...)` to an engine that has served one request, with its vLLM worker forked from the
engine core (`ForkedWorkersExecutor`, what engines do) against spawned (vLLM's multiprocessing executor as the
CPU platform sets it, what they did before), side by side in one run.

The default model's exported weights, routing capture on as in runs; each round starts one engine of each kind,
alternating which goes first, serves one 8-token request and shuts it down (shutdown not timed).

    .venv/bin/python tools/bench_engine_start.py [--rounds 3] [--tensor-parallel 1]

Last line: one JSON object; `spawned_over_forked` (median start seconds, spawned / forked) is the headline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from unittest import mock

from moe_grpo.rollout import worker_start


def start_and_serve(model_dir: str, spec: object, tensor_parallel: int, forked: bool) -> float:
    """Seconds to start one engine and serve one request; the engine is shut down after."""
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import VllmEngine

    executor = worker_start.ForkedWorkersExecutor if forked else "mp"
    with mock.patch.object(worker_start, "ForkedWorkersExecutor", executor):
        start = time.perf_counter()
        engine = VllmEngine(model_dir, spec, max_model_len=128, max_num_seqs=4, tensor_parallel=tensor_parallel)
    try:
        engine.generate([[5, 6, 7, 8]], SamplingSettings(max_tokens=8, stop_token_ids=()))
        return time.perf_counter() - start
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    args = parser.parse_args()
    from moe_grpo.config import load_model_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import export_learner

    spec = load_model_spec("deepseek_moe")
    with tempfile.TemporaryDirectory(prefix="bench_engine_start_") as tmp:
        model_dir = export_learner(MegatronLearner(spec, config=LearnerConfig()), f"{tmp}/model")
        times: dict[str, list[float]] = {"forked": [], "spawned": []}
        for i in range(args.rounds):
            order = ("spawned", "forked") if i % 2 == 0 else ("forked", "spawned")
            for arm in order:
                times[arm].append(start_and_serve(str(model_dir), spec, args.tensor_parallel, arm == "forked"))
                print(f"round {i + 1}/{args.rounds} {arm}: {times[arm][-1]:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"tensor_parallel": args.tensor_parallel, "rounds": args.rounds,
                      "forked_s": [round(t, 2) for t in times["forked"]],
                      "spawned_s": [round(t, 2) for t in times["spawned"]],
                      "forked_median_s": round(med["forked"], 2), "spawned_median_s": round(med["spawned"], 2),
                      "spawned_over_forked": round(med["spawned"] / med["forked"], 2)}))


if __name__ == "__main__":
    main()
