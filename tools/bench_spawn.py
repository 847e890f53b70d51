"""Seconds to start a group of learner ranks with `run_distributed` and run one small megatron-core job in each, with
ranks forked from the preloading process server (what `run_distributed` does) against spawned interpreters (what it
did before), side by side in one run.

Each group runs `tiny_learner_step` (one policy step of the default model on a learner of expert parallelism = ranks,
the work a multi-process test or the convert tools' verification gives its ranks), so the figure includes the
imports a rank needs. The arms alternate, spawn first, after one untimed forkserver group (the server's own start:
paid once per calling process, reported as `forkserver_first_s`).

    .venv/bin/python tools/bench_spawn.py [--groups 4] [--world 2]

Last line: one JSON object; `spawn_over_forkserver` (median seconds per group, spawn / forkserver) is the headline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from moe_grpo.learner import spawn


def tiny_learner_step(world: int) -> dict[str, float]:
    """One policy step of the default model split over the group (EP=world) on 2 random sequences."""
    import numpy as np

    from moe_grpo.config import load_model_spec
    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout

    spec = load_model_spec("deepseek_moe")
    learner = MegatronLearner(spec, ParallelLayout(1, world, 1), LearnerConfig(micro_batch_size=2, lr=1e-3))
    rng = np.random.default_rng(0)
    seqs = [LearnerSequence(rng.integers(0, spec.vocab_size, size=16), prompt_len=4, advantage=float(rng.normal()))
            for _ in range(2)]
    return learner.train_step(seqs, replay=False)


def timed_group(method: str, world: int) -> float:
    """Seconds of one `run_distributed` group whose ranks start by `method` ('spawn' or 'forkserver')."""
    start = time.perf_counter()
    spawn.run_distributed(tiny_learner_step, world, world, timeout_s=600, start_method=method)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4, help="timed groups per arm")
    parser.add_argument("--world", type=int, default=2, help="ranks per group")
    args = parser.parse_args()
    first = timed_group("forkserver", args.world)
    times: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    for i in range(args.groups):
        for method in ("spawn", "forkserver"):
            times[method].append(timed_group(method, args.world))
            print(f"group {i + 1}/{args.groups} {method}: {times[method][-1]:.2f} s", flush=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(json.dumps({"world": args.world, "groups": args.groups, "forkserver_first_s": round(first, 3),
                      "spawn_s": [round(t, 3) for t in times["spawn"]],
                      "forkserver_s": [round(t, 3) for t in times["forkserver"]],
                      "spawn_median_s": round(med["spawn"], 3), "forkserver_median_s": round(med["forkserver"], 3),
                      "spawn_over_forkserver": round(med["spawn"] / med["forkserver"], 2),
                      "preloaded": list(spawn.preloaded_here())}))


if __name__ == "__main__":
    main()
