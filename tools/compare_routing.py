"""Routing modes (r3 / r2 / off) or losses side by side on the built-in task, a bf16 engine and an fp32 learner.

Each arm is one full training run through the driver (`orchestrator.training_run.train`,
`mode=sync`, so the only train-inference gap is the engine's: bf16 weights and
CPU kernels against the fp32 Megatron learner, not staleness), with the same
budget: warm start, RL steps, batch, evaluation schedule. Per run it keeps the
held-out reward (greedy, 64 prompts) at every evaluation and `mismatch/kl`,
`mismatch/router_disagreement`, `reward/mean` at every step.

    # the routing-mode comparison: 3 modes x 3 seeds
    .venv/bin/python tools/compare_routing.py --modes r3,r2,off --seeds 0,1,2 --out outputs/compare_routing
    # the loss table: every loss, one seed, routing r3
    .venv/bin/python tools/compare_routing.py --losses grpo,dr_grpo,dapo,gspo,cispo --seeds 0 --out outputs/compare_losses

Writes `runs.jsonl` (one JSON object per run, with its per-step series), `compare.png`
(held-out reward, KL and router disagreement per step, one colour per arm) and prints
one JSON object as its last line: per arm, the mean / min / max over seeds of the final
held-out reward, and the mean per-step KL and router disagreement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time


def run_one(args: argparse.Namespace, *, replay: str, loss: str, seed: int, run_dir: str) -> dict:
    from moe_grpo.config import from_hydra, load_model_spec
    from moe_grpo.orchestrator.driver import train
    from moe_grpo.orchestrator.run_record import read_rows

    tree = {"model": dataclasses.asdict(load_model_spec(args.model)), "mode": args.mode, "steps": args.steps,
            "warm_start_steps": args.warm_start, "eval_every": args.eval_every,
            "algo": {"prompts_per_step": args.prompts, "group_size": args.group, "loss": loss,
                     "mini_batches": args.mini_batches, "max_staleness": args.max_staleness},
            "rollout": {"max_tokens": args.max_tokens, "dtype": args.engine_dtype},
            "learner": {"seed": seed, **({"lr": args.lr} if args.lr else {})}, "routing": {"replay": replay},
            "task": {"name": args.task}}
    for item in args.set:  # dotted overrides, e.g. algo.clip_ratio_high=0.004
        key, _, value = item.partition("=")
        section, _, name = key.rpartition(".")
        (tree.setdefault(section, {}) if section else tree)[name] = json.loads(value) if value[:1].isdigit() or value in (
            "true", "false") else value
    t0 = time.perf_counter()
    summary = train(from_hydra(tree), run_dir)
    rows = read_rows(os.path.join(run_dir, "metrics.jsonl"))
    return {"replay": replay, "loss": loss, "seed": seed, "seconds": round(time.perf_counter() - t0, 1),
            "evals": summary["evals"], "eval_final": summary["eval_end"], "eval_start": summary["eval_start"],
            "kl": [r["mismatch/kl"] for r in rows], "router_disagreement": [r["mismatch/router_disagreement"] for r in rows],
            "kl_replay_on": [r["mismatch/kl_replay_on"] for r in rows],
            "kl_replay_off": [r["mismatch/kl_replay_off"] for r in rows],
            "train_kl": [r["train/rollout_kl"] for r in rows],
            "reward": [r["reward/mean"] for r in rows], "replay_applied": [r["replay/applied"] for r in rows],
            "jumps": rows[-1].get("watch/jumps", 0.0) if rows else 0.0,
            "steps_skipped": summary["faults"]["steps_skipped"], "run_dir": run_dir}


def collapsed(evals: list) -> bool:
    """The collapse rule, fixed before any run: some held-out evaluation after the best one scores less than half
    of the best (the best must be above 0.1, so noise around zero is not a collapse)."""
    values = [v for _, v in evals]
    if not values:
        return False
    best = max(range(len(values)), key=values.__getitem__)
    return values[best] > 0.1 and any(v < 0.5 * values[best] for v in values[best + 1:])


def finite(xs: list) -> list[float]:
    return [float(x) for x in xs if x is not None and x == x]


def evidence(runs: list[dict], args: argparse.Namespace) -> dict:
    """`r3_evidence.json`: the engine-vs-learner gap on the same weights (the probe of every published version of
    every run: a bf16 engine against the fp32 learner holding the weights it published) and, per arm, the
    held-out reward and collapses per seed."""
    pairs = [(off, on) for r in runs for off, on in zip(r["kl_replay_off"], r["kl_replay_on"])
             if off is not None and on is not None and off == off and on == on and on > 0]
    disagreement = finite([v for r in runs for v in r["router_disagreement"]])
    arms: dict[str, dict] = {}
    for r in runs:
        arm = arms.setdefault(r["replay"], {"seeds": [], "eval_start": [], "eval_final": [], "eval_best": [],
                                            "collapsed": [], "train_kl_mean": []})
        arm["seeds"].append(r["seed"])
        arm["eval_start"].append(round(r["eval_start"], 4))
        arm["eval_final"].append(round(r["eval_final"], 4))
        arm["eval_best"].append(round(max(v for _, v in r["evals"]), 4))
        arm["collapsed"].append(collapsed(r["evals"]))
        arm["train_kl_mean"].append(statistics.fmean(finite(r["train_kl"])) if finite(r["train_kl"]) else None)
    for arm in arms.values():
        arm["collapse_count"] = sum(arm["collapsed"])
        arm["eval_final_mean"] = round(statistics.fmean(arm["eval_final"]), 4)
        arm["eval_final_spread"] = round(max(arm["eval_final"]) - min(arm["eval_final"]), 4)
    return {
        "model": args.model, "engine_dtype": args.engine_dtype, "learner_dtype": "float32", "mode": args.mode,
        "steps": args.steps, "lr": args.lr, "mini_batches": args.mini_batches, "max_staleness": args.max_staleness,
        "collapse_rule": collapsed.__doc__.strip(),
        "router_disagreement_same_weights": statistics.median(disagreement) if disagreement else None,
        "router_disagreement_same_weights_p90": (statistics.quantiles(disagreement, n=10)[-1]
                                                 if len(disagreement) > 1 else None),
        "kl_replay_off_same_weights": statistics.median([p[0] for p in pairs]) if pairs else None,
        "kl_replay_on_same_weights": statistics.median([p[1] for p in pairs]) if pairs else None,
        "kl_off_over_r3_same_weights": statistics.median([off / on for off, on in pairs]) if pairs else None,
        "probes": len(pairs), "arms": arms,
    }


def summarise(runs: list[dict], key: str) -> dict:
    arms: dict[str, list[dict]] = {}
    for r in runs:
        arms.setdefault(r[key], []).append(r)
    out = {}
    for arm, rs in arms.items():
        finals = [r["eval_final"] for r in rs]
        kls = [statistics.fmean(r["kl"]) for r in rs]
        dis = [statistics.fmean(r["router_disagreement"]) for r in rs]
        out[arm] = {"seeds": [r["seed"] for r in rs], "eval_start": [round(r["eval_start"], 4) for r in rs],
                    "eval_final": [round(f, 4) for f in finals], "eval_final_mean": round(statistics.fmean(finals), 4),
                    "eval_final_min": round(min(finals), 4), "eval_final_max": round(max(finals), 4),
                    "kl_mean": statistics.fmean(kls), "kl_max": max(max(r["kl"]) for r in rs),
                    "router_disagreement_mean": statistics.fmean(dis),
                    "router_disagreement_max": max(max(r["router_disagreement"]) for r in rs),
                    "replay_applied_mean": statistics.fmean(v for r in rs for v in r["replay_applied"]),
                    "jump_warnings": sum(r["jumps"] for r in rs), "seconds_per_run": round(
                        statistics.fmean(r["seconds"] for r in rs), 1)}
    return out


def plot(runs: list[dict], key: str, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({r[key] for r in runs}, key=[r[key] for r in runs].index)
    colours = {a: f"C{i}" for i, a in enumerate(arms)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in runs:
        c = colours[r[key]]
        label = f"{r[key]} seed {r['seed']}"
        axes[0].plot([s for s, _ in r["evals"]], [v for _, v in r["evals"]], "o-", color=c, alpha=0.8, label=label)
        steps = range(1, len(r["kl"]) + 1)
        axes[1].plot(steps, r["kl"], color=c, alpha=0.6)
        axes[2].plot(steps, r["router_disagreement"], color=c, alpha=0.6)
    axes[0].set_title("held-out reward (greedy)")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=7)
    axes[1].set_title("mismatch/kl (rollout || learner)")
    axes[1].set_yscale("symlog", linthresh=1e-7)
    axes[2].set_title("mismatch/router_disagreement")
    for a in axes:
        a.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="r3,r2,off", help="routing.replay values to compare (with --losses: one)")
    ap.add_argument("--losses", default="", help="compare these algo.loss values instead of routing modes")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--model", default="deepseek_moe")
    ap.add_argument("--task", default="reverse")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warm-start", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--mode", default="sync", choices=["sync", "async"],
                    help="async adds staleness (up to --max-staleness versions) to the engine's bf16 gap")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per batch (every arm)")
    ap.add_argument("--lr", type=float, default=0.0, help="learner.lr for every arm (0: the default)")
    ap.add_argument("--evidence", default="", help="also write the routing-replay evidence summary here "
                    "(tools/results/r3_evidence.json)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every arm, e.g. --set algo.clip_ratio_high=0.004 (repeatable)")
    ap.add_argument("--out", default="outputs/compare_routing")
    args = ap.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    os.makedirs(args.out, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    losses = [x for x in args.losses.split(",") if x]
    modes = [x for x in args.modes.split(",") if x]
    key = "loss" if losses else "replay"
    arms = [(modes[0], loss) for loss in losses] if losses else [(m, "grpo") for m in modes]
    runs = []
    with open(os.path.join(args.out, "runs.jsonl"), "a") as f:
        for seed in seeds:
            for replay, loss in arms:
                run_dir = os.path.join(args.out, f"{replay}_{loss}_seed{seed}")
                r = run_one(args, replay=replay, loss=loss, seed=seed, run_dir=run_dir)
                runs.append(r)
                f.write(json.dumps(r) + "\n")
                f.flush()
                print(f"[compare] {key}={r[key]} seed={seed}: held-out {r['eval_start']:.3f} -> {r['eval_final']:.3f}, "
                      f"mean kl {statistics.fmean(r['kl']):.3g}, mean router disagreement "
                      f"{statistics.fmean(r['router_disagreement']):.3g}, {r['seconds']:.0f} s", flush=True)
    title = (f"{args.model}, {args.task}, engine {args.engine_dtype} vs fp32 learner, {args.warm_start} warm-start + "
             f"{args.steps} {args.mode} steps of {args.prompts}x{args.group}, {args.mini_batches} update(s) per batch")
    if args.evidence and not losses:
        with open(args.evidence, "w") as f:
            json.dump(evidence(runs, args), f, indent=1)
    png = os.path.join(args.out, "compare.png")
    plot(runs, key, png, title)
    print(json.dumps({"bench": "compare_" + ("losses" if losses else "routing"), "arms": key, "task": args.task,
                      "engine_dtype": args.engine_dtype, "learner_dtype": "float32", "mode": args.mode, "model": args.model,
                      "steps": args.steps, "warm_start_steps": args.warm_start, "prompts_per_step": args.prompts,
                      "group_size": args.group, "eval_every": args.eval_every,
                      "routing": modes[0] if losses else None, "overrides": args.set, "png": png, "results": summarise(runs, key)}))


if __name__ == "__main__":
    main()
