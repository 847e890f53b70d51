"""Held-out and training reward of finished runs side by side, read from their `metrics.jsonl`.

    .venv/bin/python tools/plot_runs.py --out lora_vs_full.png full=/tmp/ft_full lora=/tmp/ft_lora

Each argument is LABEL=RUN_DIR. Writes one figure (held-out reward at every evaluation; training reward, mean
of 10-step windows) and prints one JSON object as its last line: per run, the held-out reward at each evaluated
step and the run's seconds per step (median).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def series(run_dir: str) -> dict:
    from moe_grpo.orchestrator.run_record import read_rows

    rows = read_rows(Path(run_dir) / "metrics.jsonl")
    evals = sorted({int(r["eval/step"]): r["eval/reward/mean"] for r in rows if "eval/reward/mean" in r}.items())
    train = [r["reward/mean"] for r in rows]
    return {"evals": evals, "train": train,
            "seconds_per_step": statistics.median(r["time/step_seconds"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    ap.add_argument("--out", required=True, help="the figure's path (.png)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for arg in args.runs:
        label, sep, run_dir = arg.partition("=")
        if not sep or not run_dir:
            ap.error(f"{arg!r}: expected LABEL=RUN_DIR")
        runs[label] = series(run_dir)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, s in runs.items():
        axes[0].plot([k for k, _ in s["evals"]], [v for _, v in s["evals"]], "o-", label=label)
        windows = [statistics.fmean(s["train"][i:i + 10]) for i in range(0, len(s["train"]), 10)]
        axes[1].plot([i + 10 for i in range(0, len(s["train"]), 10)], windows, label=label)
    axes[0].set_title("held-out reward (greedy, 64 prompts)")
    axes[1].set_title("training reward (10-step means)")
    for a in axes:
        a.set_xlabel("step")
        a.set_ylim(0, 1)
        a.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(json.dumps({label: {"held_out": s["evals"], "seconds_per_step": round(s["seconds_per_step"], 3)}
                      for label, s in runs.items()}))


if __name__ == "__main__":
    main()
