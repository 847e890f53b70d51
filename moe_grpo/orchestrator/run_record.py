"""The run record: metrics.jsonl (one object per optimizer step), TensorBoard events, a progress bar, a PNG.

Every step's object holds every key of the README's run-record contract;
keys that are measured less often than every step (`eval/reward/mean`)
carry their latest value, with `eval/step` saying when it was taken.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

REQUIRED_KEYS = (
    "step", "policy_version", "reward/mean", "reward/std", "mismatch/kl", "mismatch/router_disagreement",
    "replay/applied", "staleness/mean", "staleness/max", "throughput/rollout_tokens_per_s",
    "throughput/train_tokens_per_s", "util/train_busy", "util/infer_busy", "sync/seconds", "sync/bytes",
    "eval/reward/mean", "reward/failed", "data/bad_rows",
    "correction/truncated_fraction", "correction/masked_fraction", "kl/reference", "dynamic_sampling/dropped_groups",
    "watch/jumps",
)
"""Keys on every line of metrics.jsonl (plus `faults/*`); `kl/reference` is NaN unless algo.kl_coef > 0."""


class RunRecord:
    """Writes one step at a time; `close()` draws the PNG."""

    def __init__(self, run_dir: str | Path, total_steps: int, *, progress: bool = True) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._file = open(self.path, "a")
        self.rows: list[dict[str, float]] = []
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        except ImportError:  # tensorboard is a declared dependency; a broken install only loses the events
            print("[run] tensorboard is not importable; no event files will be written", file=sys.stderr)
        self._bar: Any = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def log(self, row: dict[str, float]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise KeyError(f"step {row.get('step')}: run-record keys {missing} missing")
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in row.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        self._file.flush()
        self.rows.append(clean)
        step = int(row["step"])
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v) and k != "step":
                    self._tb.add_scalar(k, v, step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(
                f"reward {row['reward/mean']:.3f} eval {row['eval/reward/mean']:.3f} "
                f"tok/s {row['throughput/rollout_tokens_per_s']:.0f} stale {row['staleness/mean']:.2f}", refresh=False)

    def close(self) -> Path | None:
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        return plot(self.rows, self.dir / "metrics.png") if self.rows else None


def plot(rows: list[dict[str, float]], path: Path) -> Path:
    """Reward (train and held-out), mismatch KL, router disagreement and staleness per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax = axes[0][0]
    ax.plot(steps, [r["reward/mean"] for r in rows], label="train (sampled)")
    evals = sorted({(r["eval/step"], r["eval/reward/mean"]) for r in rows if r.get("eval/step", -1) >= 0})
    ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="held-out (greedy)")
    ax.set_title("reward")
    ax.set_ylim(0, 1)
    ax.legend()
    axes[0][1].plot(steps, [r["mismatch/kl"] for r in rows])
    axes[0][1].set_title("mismatch/kl (rollout || learner)")
    axes[0][1].set_yscale("symlog", linthresh=1e-8)
    axes[1][0].plot(steps, [r["mismatch/router_disagreement"] for r in rows])
    axes[1][0].set_title("router disagreement (free learner vs rollout)")
    axes[1][1].plot(steps, [r["staleness/mean"] for r in rows], label="mean")
    axes[1][1].plot(steps, [r["staleness/max"] for r in rows], label="max")
    axes[1][1].set_title("staleness (versions)")
    axes[1][1].legend()
    for a in axes[1]:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
