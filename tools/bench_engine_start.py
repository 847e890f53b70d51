"""Seconds from `VllmEngine(...)` to an engine that has served one request, three ways side by side in one run:

- `forked`: what engines do. vLLM's engine core is forked from this process's engine-core server, which imported
  vLLM once (rollout/engine_core_start.py), and its vLLM worker is forked from the engine core
  (`ForkedWorkersExecutor`, rollout/worker_start.py);
- `core_spawned`: the engine core spawned (vLLM's own `get_mp_context`, what engines did before
  engine_core_start), its worker still forked;
- `spawned`: both spawned (vLLM's multiprocessing executor as the CPU platform sets it, what engines did before
  worker_start).

The default model's exported weights, routing capture on as in runs; the server is started and has imported vLLM
before the first round (`server_ready_s`: what the first engine start of a process pays once, or an engine actor
while it imports vLLM itself); each round starts one engine of each kind, in a rotating order, serves one 8-token
request and shuts it down (shutdown not timed).

    .venv/bin/python tools/bench_engine_start.py [--rounds 3] [--tensor-parallel 1]

Last line: one JSON object; `core_spawned_over_forked` and `spawned_over_forked` (median start seconds over the
`forked` arm's) are the headlines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from unittest import mock

from moe_grpo.rollout import engine_core_start, worker_start

ARMS = ("forked", "core_spawned", "spawned")


def _noop() -> None:
    pass


def server_ready() -> float:
    """Seconds to start this process's engine-core server and have it import vLLM (one process forked from it)."""
    start = time.perf_counter()
    engine_core_start.start_server()
    proc = engine_core_start.ENGINE_CORE_CONTEXT.Process(target=_noop)
    proc.start()
    proc.join()
    return time.perf_counter() - start


def start_and_serve(model_dir: str, spec: object, tensor_parallel: int, arm: str) -> float:
    """Seconds to start one engine as `arm` starts it and serve one request; the engine is shut down after."""
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import VllmEngine

    executor = "mp" if arm == "spawned" else worker_start.ForkedWorkersExecutor
    install = engine_core_start.install if arm == "forked" else lambda: False
    engine_core_start.revert()
    with mock.patch.object(worker_start, "ForkedWorkersExecutor", executor), \
            mock.patch.object(engine_core_start, "install", install):
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
    ready_s = server_ready()
    print(f"engine-core server ready in {ready_s:.2f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_engine_start_") as tmp:
        model_dir = export_learner(MegatronLearner(spec, config=LearnerConfig()), f"{tmp}/model")
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for i in range(args.rounds):
            for arm in ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]:
                times[arm].append(start_and_serve(str(model_dir), spec, args.tensor_parallel, arm))
                print(f"round {i + 1}/{args.rounds} {arm}: {times[arm][-1]:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"tensor_parallel": args.tensor_parallel, "rounds": args.rounds,
                      "server_ready_s": round(ready_s, 2),
                      **{f"{arm}_s": [round(t, 2) for t in times[arm]] for arm in ARMS},
                      **{f"{arm}_median_s": round(med[arm], 2) for arm in ARMS},
                      "core_spawned_over_forked": round(med["core_spawned"] / med["forked"], 2),
                      "spawned_over_forked": round(med["spawned"] / med["forked"], 2)}))


if __name__ == "__main__":
    main()
