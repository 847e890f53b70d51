"""Rollout tokens/s of an engine at tensor parallelism 2 divided by a one-worker engine's, same prompts, one run.

Two `VllmEngine`s on the same weights (the default model unless --model), routing capture on as in runs: one at
TP=1 (vLLM's one-process executor, its OpenMP threads on core 0) and one at TP=2 (the multiprocessing executor,
one worker per core as `cpu_omp_bind` splits this process's cores: on 2 cores, core 0 and core 1). They take
turns, alternating which goes first, so machine drift hits both arms; greedy sampling without a stop token keeps
the work identical.

Where the time goes: a timer installed in every worker (a function sent through `collective_rpc`; it wraps
methods of that worker's own objects and changes nothing they compute) adds up, over the timed rounds,
- `execute_s`: the worker's `execute_model` (and `sample_tokens`, where vLLM splits a step in two): the forward
  passes, sampling and capture, everything a step does in the worker;
- `collective_s`: calls into the tensor-parallel group's communicator (all-reduce after each row-parallel
  matmul and the MoE block, the LM head's gather); this includes the time a worker waits there for the other;
- `capture_s` (rank 0 only; other ranks never capture): the router hooks copying each layer's top-k ids and the
  per-step filing of those rows under their requests.
Each is divided by the engine's wall time of the same rounds; `outside_workers_fraction` (1 - execute / wall on
the slowest worker) is the engine core's scheduling, the IPC to the workers and back, and output handling.
Sending a function to the workers needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (cloudpickle over vLLM's local
sockets), set for this process's engines only.

    .venv/bin/python tools/bench_engine_tp.py [--prompts 16] [--prompt-len 64] [--max-tokens 64] [--rounds 4]

Last line: one JSON object; `tp2_over_tp1_tokens_per_s` is the headline.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from interleave import engine_bench_parser, interleaved_medians  # tools/ is sys.path[0] when a bench runs


def install_timers(wrapper: Any) -> dict[str, Any]:
    """In a vLLM worker process (`wrapper`: its WorkerWrapperBase): wrap the step, the TP communicator and the
    routing capture with timers adding into `worker._bench_stats`. Returns the worker's pid and TP rank."""
    import functools
    import time as _time

    from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    worker = wrapper.worker
    stats = {"execute_s": 0.0, "steps": 0, "collective_s": 0.0, "collectives": 0, "capture_s": 0.0}
    worker._bench_stats = stats

    def timed(fn: Any, seconds: str, count: str | None) -> Any:
        @functools.wraps(fn)
        def run(*a: Any, **k: Any) -> Any:
            t0 = _time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                stats[seconds] += _time.perf_counter() - t0
                if count:
                    stats[count] += 1
        return run

    for name, count in (("execute_model", "steps"), ("sample_tokens", None)):
        if hasattr(worker, name):
            setattr(worker, name, timed(getattr(worker, name), "execute_s", count))
    comm = get_tp_group().device_communicator
    if comm is not None and get_tp_group().world_size > 1:
        for name in ("all_reduce", "all_gather", "gather", "reduce_scatter", "broadcast"):
            if hasattr(comm, name):
                setattr(comm, name, timed(getattr(comm, name), "collective_s", "collectives"))
    rank = int(get_tensor_model_parallel_rank())
    if rank == 0 and getattr(worker, "_mg_capture", False):  # the extension's hooks, on the capturing rank
        for module in worker.model_runner.get_model().modules():
            router = getattr(module, "router", None)
            if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
                router.set_capture_fn(timed(functools.partial(worker._mg_on_route, int(module.layer_id)),
                                            "capture_s", None))
        worker._mg_flush = timed(worker._mg_flush, "capture_s", None)
    return {"pid": os.getpid(), "tp_rank": rank}


def read_timers(wrapper: Any, reset: bool) -> dict[str, Any]:
    """The worker's sums so far (and zero them with `reset`)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    stats = wrapper.worker._bench_stats
    out = {"tp_rank": int(get_tensor_model_parallel_rank()), **stats}
    if reset:
        for k in stats:
            stats[k] = 0 if isinstance(stats[k], int) else 0.0
    return out


def worker_call(engine: Any, fn: Any, *args: Any) -> list[dict[str, Any]]:
    """`fn(worker_wrapper, *args)` in every worker of `engine`, their answers in TP-rank order."""
    answers = engine._call(engine.llm.collective_rpc(fn, args=args), fn.__name__, 60.0)
    return sorted(answers, key=lambda a: a["tp_rank"])


def breakdown(workers: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Each worker's sums as fractions of the engine's wall time over the same rounds."""
    slowest = max(w["execute_s"] for w in workers)
    return {
        "steps": workers[0]["steps"],
        "wall_s": round(wall_s, 3),
        "execute_fraction": [round(w["execute_s"] / wall_s, 3) for w in workers],
        "collective_fraction": [round(w["collective_s"] / wall_s, 3) for w in workers],
        "collectives_per_step": [round(w["collectives"] / max(w["steps"], 1), 1) for w in workers],
        "capture_fraction": round(workers[0]["capture_s"] / wall_s, 4),
        "outside_workers_fraction": round(1.0 - slowest / wall_s, 3),
        "ms_per_step": {"wall": round(1e3 * wall_s / max(workers[0]["steps"], 1), 2),
                        "execute": [round(1e3 * w["execute_s"] / max(w["steps"], 1), 2) for w in workers],
                        "collective": [round(1e3 * w["collective_s"] / max(w["steps"], 1), 2) for w in workers]},
    }


def main() -> None:
    args = engine_bench_parser(__doc__).parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # install_timers travels to the workers by cloudpickle
    import numpy as np

    from moe_grpo.config import load_model_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import export_learner
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import VllmEngine

    spec = load_model_spec(args.model)
    learner = MegatronLearner(spec, config=LearnerConfig())
    model_dir = export_learner(learner, tempfile.mkdtemp(prefix="bench_engine_tp_") + "/model")
    del learner
    kwargs = dict(max_model_len=args.prompt_len + args.max_tokens + 8, max_num_seqs=args.prompts, capture=True)
    engines = {1: VllmEngine(model_dir, spec, name="tp1", **kwargs)}
    try:
        engines[2] = VllmEngine(model_dir, spec, name="tp2", tensor_parallel=2, **kwargs)
        binds = {tp: e._omp_bind for tp, e in engines.items()}
        installed = {tp: worker_call(e, install_timers) for tp, e in engines.items()}
        assert [w["tp_rank"] for w in installed[2]] == [0, 1], installed
        rng = np.random.default_rng(0)
        prompts = [list(map(int, rng.integers(3, spec.vocab_size, size=args.prompt_len)))
                   for _ in range(args.prompts)]
        sampling = SamplingSettings(n=1, temperature=0.0, max_tokens=args.max_tokens, stop_token_ids=())
        wall = {1: 0.0, 2: 0.0}
        outputs: dict[int, list] = {}

        def run(tp: int) -> float:
            engine = engines[tp]
            t0 = time.perf_counter()
            out = engine.generate(prompts, sampling)
            dt = time.perf_counter() - t0
            wall[tp] += dt
            assert all(c.routing is not None for g in out for c in g), f"TP={tp}: a completion without routing"
            outputs[tp] = [list(map(int, c.token_ids)) for g in out for c in g]
            return sum(len(c.token_ids) for g in out for c in g) / dt

        def reset() -> None:  # after the warm-up round: only timed rounds count
            for tp, e in engines.items():
                worker_call(e, read_timers, True)
                wall[tp] = 0.0

        run(1), run(2)  # noqa: B018 - warm-up, untimed
        reset()
        one, two = interleaved_medians(lambda: run(1), lambda: run(2), args.rounds, warmup=0)
        timers = {tp: worker_call(e, read_timers, False) for tp, e in engines.items()}
        same_tokens = outputs[1] == outputs[2]
        result = {
            "bench": "engine_tp", "model": spec.name, "prompts": args.prompts, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "cores": len(os.sched_getaffinity(0)),
            "omp_bind": {f"tp{tp}": b for tp, b in binds.items()},
            "start_seconds": {f"tp{tp}": round(e.start_seconds, 1) for tp, e in engines.items()},
            "tokens_per_s_tp1": round(one, 1), "tokens_per_s_tp2": round(two, 1),
            "tp2_over_tp1_tokens_per_s": round(two / one, 4),
            "greedy_tokens_equal": same_tokens,
            "where_time_goes": {f"tp{tp}": breakdown(timers[tp], wall[tp]) for tp in engines},
        }
    finally:
        for e in engines.values():
            e.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
