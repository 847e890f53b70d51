"""Asynchronous vs synchronous schedule, side by side in one run, each pool held to one core.

Runs the same training (model, batch, steps, seed) twice through the one
driver: `mode=sync` (generate, train, sync in turn) then `mode=async`. The
engine actor (with vLLM's processes) is pinned to core 0 and the learner rank
to core 1 (`cluster.pin_cpus`). Both runs train the same number of samples.

From the sync run's phase times (median generate phase = step time minus
train time; median train time) the ideal overlap speedup is
(gen + train) / max(gen, train); `async_vs_ideal_ratio` is the measured
speedup over that. `train_busy` / `infer_busy` are the pools' busy fractions in
async mode. Only the slower phase's pool can be kept busy: when generation is
slower, the learner can be busy at most train / gen of the time
(`train_busy_bound`), so the figure that says "the hardware never idles" is
`bottleneck_busy`, the busy fraction of the slower phase's pool. Choose the
workload with the flags: the defaults are generation-bound; fewer tokens per
completion and longer prompts (`--letters 40 --max-tokens 4`: the learner
trains on every prompt token, the engine prefills them in one batched pass)
make training the slower phase.

The async run is made twice, with the mismatch probe as configured by default
(`async_vs_ideal_ratio`) and with `routing.probe_every=0`
(`async_vs_ideal_ratio_probe_off`), both against the same sync run (the
default config, probe on): the gap between the two, and
`async_step_probe_on_over_off` (mean async step with the probe over without),
is what the probe costs the overlap; `probe_versions_reported` and
`probe_kl_max` say what the probe measured meanwhile. `--no-probe-off` skips
the second async run; `--rows-out DIR` keeps each run's metrics.jsonl.

    .venv/bin/python tools/bench_async.py [--steps 30] [--prompts 32] [--group 8] [--max-tokens 16] [--letters 0]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile


def run_mode(mode: str, args: argparse.Namespace, probe: bool = True) -> list[dict]:
    """The run's rows; `probe=False`: with routing.probe_every=0."""
    from moe_grpo.config import from_hydra, load_model_spec
    from moe_grpo.orchestrator.training_run import train
    from moe_grpo.orchestrator.run_record import read_rows

    tree = {"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "mode": mode, "steps": args.steps,
            "warm_start_steps": 0, "eval_every": 0,
            "algo": {"prompts_per_step": args.prompts, "group_size": args.group},
            "rollout": {"max_tokens": args.max_tokens},
            "task": {"min_len": args.letters or 3, "max_len": args.letters or 5},
            "cluster": {"pin_cpus": True, "engine_cpus": 1, "learner_cpus": 1}}
    if not probe:
        tree["routing"] = {"probe_every": 0}
    with tempfile.TemporaryDirectory(prefix=f"bench_async_{mode}_") as d:
        train(from_hydra(tree), d)
        if args.rows_out:  # the per-step rows, to see where a run's time went
            os.makedirs(args.rows_out, exist_ok=True)
            shutil.copy(os.path.join(d, "metrics.jsonl"),
                        os.path.join(args.rows_out, f"{mode}{'' if probe else '_probe_off'}.jsonl"))
        return read_rows(os.path.join(d, "metrics.jsonl"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--letters", type=int, default=0, help="letters per prompt (0: the task's 3-5)")
    p.add_argument("--rows-out", default="", help="copy each run's metrics.jsonl into this folder")
    p.add_argument("--no-probe-off", action="store_true", help="skip the async run with routing.probe_every=0")
    args = p.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("bench_async needs 2 cores (one per pool)")
    sync, asyn = run_mode("sync", args), run_mode("async", args)
    warm = 2  # the first steps include start-up effects (first syncs fault in fresh pages)
    s_rows, a_rows = sync[warm:], asyn[warm:]
    train_s = statistics.median(r["time/train_seconds"] for r in s_rows)
    gen_s = statistics.median(r["time/step_seconds"] - r["time/train_seconds"] for r in s_rows)
    sync_step = statistics.mean(r["time/step_seconds"] for r in s_rows)
    async_step = statistics.mean(r["time/step_seconds"] for r in a_rows)
    speedup = sync_step / async_step
    ideal = (gen_s + train_s) / max(gen_s, train_s)
    samples = args.steps * args.prompts * args.group
    train_busy = statistics.mean(r["util/train_busy"] for r in a_rows)
    infer_busy = statistics.mean(r["util/infer_busy"] for r in a_rows)
    gen_bound = gen_s >= train_s
    probe_off = {}
    if not args.no_probe_off:
        off_rows = run_mode("async", args, probe=False)[warm:]
        off_step = statistics.mean(r["time/step_seconds"] for r in off_rows)
        probe_off = {"async_step_seconds_probe_off": round(off_step, 3),
                     "async_step_probe_on_over_off": round(async_step / off_step, 3),
                     "async_vs_ideal_ratio_probe_off": round(sync_step / off_step / ideal, 3),
                     "infer_busy_probe_off": round(statistics.mean(r["util/infer_busy"] for r in off_rows), 3)}
    def measured(key: str) -> list[float]:  # a row before the first finished probe holds null (NaN)
        return [r[key] for r in a_rows if r.get(key) is not None and r[key] == r[key]]

    print(json.dumps({
        "steps": args.steps, "trained_samples_sync": samples, "trained_samples_async": samples,
        "sync_step_seconds": round(sync_step, 3), "async_step_seconds": round(async_step, 3),
        "gen_phase_seconds": round(gen_s, 3), "train_phase_seconds": round(train_s, 3),
        "async_speedup": round(speedup, 3), "ideal_speedup": round(ideal, 3),
        "async_vs_ideal_ratio": round(speedup / ideal, 3), **probe_off,
        "bottleneck": "generation" if gen_bound else "training",
        "train_busy": round(train_busy, 3), "infer_busy": round(infer_busy, 3),
        "train_busy_bound": round(min(1.0, train_s / gen_s), 3),
        "bottleneck_busy": round(infer_busy if gen_bound else train_busy, 3),
        "async_staleness_mean": round(statistics.mean(r["staleness/mean"] for r in a_rows), 3),
        "probe_versions_reported": len(set(measured("mismatch/probe_version"))),
        "probe_kl_max": max(measured("mismatch/kl"), default=float("nan")),
    }))


if __name__ == "__main__":
    main()
