"""The run record: metrics.jsonl (one object per optimizer step), TensorBoard events, a progress bar, a PNG, and
the experiment trackers `logger.*` turns on (W&B, MLflow: orchestrator/trackers.py).

Every step's object holds every key of the run-record contract (docs/reference/metrics.md);
keys that are measured less often than every step (`eval/reward/mean`)
carry their latest value, with `eval/step` saying when it was taken.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from tqdm import tqdm

REQUIRED_KEYS = (
    "step", "policy_version", "reward/mean", "reward/std", "mismatch/kl", "mismatch/router_disagreement",
    "mismatch/probe_version", "train/rollout_kl", "train/router_disagreement", "offpolicy/kl",
    "offpolicy/router_disagreement", "offpolicy/stale_fraction", "replay/applied", "staleness/mean", "staleness/max", "throughput/rollout_tokens_per_s",
    "throughput/train_tokens_per_s", "util/train_busy", "util/infer_busy", "sync/seconds", "sync/bytes",
    "sync/full_bytes", "sync/changed_fraction", "sync/experts_unchanged", "sync/delta",
    "eval/reward/mean", "reward/failed", "data/bad_rows",
    "correction/truncated_fraction", "correction/masked_fraction", "kl/reference", "dynamic_sampling/dropped_groups",
    "watch/jumps", "watch/rollbacks", "faults/engine_restarts", "faults/requests_resubmitted", "faults/requests_lost",
    "faults/steps_skipped",
)
"""Keys on every line of metrics.jsonl (a value not measured is written as null; `read_rows` reads it back as NaN);
`kl/reference` is NaN unless algo.kl_coef > 0, `mismatch/*` NaN before the
first probe finished (or with routing.probe_prompts=0), `offpolicy/kl` NaN on a step that trained no stale token."""


log = logging.getLogger("moe_grpo")


class RecordWriteError(RuntimeError):
    """metrics.jsonl could not be written (a full disk, the run directory removed); names the file and the error."""


class RunRecord:
    """Writes one step at a time; `close()` draws the PNG."""

    def __init__(self, run_dir: str | Path, total_steps: int, *, progress: bool = True,
                 resume_step: int | None = None, trackers: list[Any] | None = None) -> None:
        """`resume_step`: continue the record of a run resumed from the checkpoint of that step (rows written after
        it, by the process that was interrupted, are dropped: the resumed run writes those steps again).
        `trackers`: the run's experiment trackers (trackers.open_trackers), which get each row from now on; whoever
        opened them ends them (as the run ended: `trackers.close_trackers`). A resumed run's go on in the tracker runs
        of its checkpoint and get the steps after it again (W&B drops a step it already has: it keeps the
        interrupted process's values of those steps; MLflow keeps both)."""
        # The PNG is drawn as the run ends, on its critical path: matplotlib's import (~0.5-0.9 s on 2 cores) is
        # done now, beside the steps, where the driver mostly waits on its actors.
        self._plotting = threading.Thread(target=_import_plotting, name="moe_grpo-import-matplotlib", daemon=True)
        self._plotting.start()
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.rows: list[dict[str, float]] = []
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = _row(line)  # nulls back to NaN, as the rows this process logs hold them
                except ValueError:  # the interrupted process's last line may be cut short
                    continue
                if row.get("step", 0) <= resume_step:
                    self.rows.append(row)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(_line(r) for r in self.rows))
            tmp.replace(self.path)
        self._file = open(self.path, "a")
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        except ImportError:  # tensorboard is a declared dependency; a broken install only loses the events
            print("[run] tensorboard is not importable; no event files will be written", file=sys.stderr)
        self._trackers: list[Any] = list(trackers or [])
        self._bar: Any = None
        if progress:
            self._bar = tqdm(total=total_steps, initial=len(self.rows), desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr)

    def log(self, row: dict[str, float]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise KeyError(f"step {row.get('step')}: run-record keys {missing} missing")
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in row.items()}
        try:
            self._file.write(_line(clean))
            self._file.flush()
            if os.fstat(self._file.fileno()).st_nlink == 0:  # writes to a removed file succeed, into nothing
                raise FileNotFoundError(f"{self.path} was removed (its run directory deleted?)")
        except OSError as e:  # a full disk, the run directory removed: the run stops naming it, not in a traceback
            raise RecordWriteError(f"the run record {self.path} could not be written at step {row['step']:g}: "
                                   f"{type(e).__name__}: {e}") from e
        self.rows.append(clean)
        step = int(row["step"])
        if self._tb is not None:
            try:
                for k, v in clean.items():
                    if isinstance(v, float) and math.isfinite(v) and k != "step":
                        self._tb.add_scalar(k, v, step)
            except OSError as e:  # TensorBoard's copy only: metrics.jsonl keeps the record
                self._drop_tensorboard(e)
        for tracker in self._trackers:
            tracker.log(clean)
        if self._bar is not None:  # the step's figures, then the count (its refresh shows both: before, a step late)
            held_out = row["eval/reward/mean"]
            self._bar.set_postfix_str(
                f"reward {row['reward/mean']:.3f}" + (f" eval {held_out:.3f}" if math.isfinite(held_out) else "")
                + f" tok/s {row['throughput/rollout_tokens_per_s']:.0f} stale {row['staleness/mean']:.2f}",
                refresh=False)
            self._bar.update(1)

    def close(self) -> Path | None:
        """Close the files and draw the PNG; its path (None without rows)."""
        self.close_files()
        return self.draw()

    def close_files(self) -> None:
        try:
            self._file.close()
        except OSError:  # its last write failed already (RecordWriteError said so)
            pass
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as e:
                self._drop_tensorboard(e)

    def _drop_tensorboard(self, e: OSError) -> None:
        """TensorBoard's event file failed (a full disk, its directory removed): warn once and write no more events;
        before 2026-11-28 the failure stopped the run with a traceback."""
        log.warning("TensorBoard's event file could not be written (%s: %s); no more events this run, metrics.jsonl "
                    "keeps the record", type(e).__name__, e)
        tb, self._tb = self._tb, None
        try:
            tb.close()
        except OSError:
            pass

    def draw(self) -> Path | None:
        """The PNG of the rows (`plot`); its path, None without rows."""
        self._plotting.join()
        return plot(self.rows, self.dir / "metrics.png") if self.rows else None


def _import_plotting() -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except Exception:  # noqa: BLE001 - `plot` imports it again and raises there, where the run reports it
        pass


def plot(rows: list[dict[str, float]], path: Path) -> Path:
    """Reward (train and held-out), mismatch KL, router disagreement, staleness and the weight sync per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 2, figsize=(11, 10), sharex=True)
    ax = axes[0][0]
    ax.plot(steps, [r["reward/mean"] for r in rows], label="train (sampled)")
    evals = sorted({(r["eval/step"], r["eval/reward/mean"]) for r in rows if r.get("eval/step", -1) >= 0})
    ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="held-out (greedy)")
    ax.set_title("reward")
    ax.set_ylim(0, 1)
    ax.legend()
    ax = axes[0][1]
    ax.plot(steps, [_value(r, "mismatch/kl") for r in rows], ".-", label="engine vs learner, same weights (probe)")
    ax.plot(steps, [_value(r, "offpolicy/kl") for r in rows], label="drift on stale tokens (offpolicy/kl)")
    ax.set_title("KL(rollout || learner), k3")
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.plot(steps, [_value(r, "mismatch/router_disagreement") for r in rows], ".-", label="same weights (probe)")
    ax.plot(steps, [_value(r, "offpolicy/router_disagreement") for r in rows], label="stale tokens (offpolicy)")
    ax.set_title("router disagreement (free learner vs rollout)")
    ax.legend(fontsize=8)
    axes[1][1].plot(steps, [r["staleness/mean"] for r in rows], label="mean")
    axes[1][1].plot(steps, [r["staleness/max"] for r in rows], label="max")
    axes[1][1].set_title("staleness (versions)")
    axes[1][1].legend()
    ax = axes[2][0]
    ax.plot(steps, [_value(r, "sync/bytes") / _value(r, "sync/full_bytes") for r in rows], ".-",
            label="bytes sent / a full version")
    ax.plot(steps, [_value(r, "sync/changed_fraction") for r in rows], label="elements changed (sync.delta)")
    ax.set_title("weight sync: what each version carried")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    axes[2][1].plot(steps, [_value(r, "sync/seconds") for r in rows])
    axes[2][1].set_title("weight sync: seconds (slowest learner rank)")
    for a in axes[2]:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _line(row: Mapping[str, Any]) -> str:
    """A row as one line of strict JSON: a value not measured (NaN, or an infinity) is written as null, because strict
    readers (jq, JavaScript's JSON.parse) refuse NaN; allow_nan=False makes any other non-finite value an error here
    rather than a line they cannot read."""
    strict = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json.dumps(strict, sort_keys=True, allow_nan=False) + "\n"


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, a `null` (a value not measured) read back as NaN, for code that computes."""
    with open(path) as f:
        return [_row(line) for line in f if line.strip()]


def _row(line: str) -> dict[str, Any]:
    return {k: (float("nan") if v is None else v) for k, v in json.loads(line).items()}


def _value(row: dict[str, Any], key: str) -> float:
    """A row's value as a float for plotting (NaN where missing, not measured or zero-sized)."""
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and (value or key != "sync/full_bytes") else float("nan")


def step_row(state: Any, metrics: dict[str, float], groups: list[Any], *, trained_version: int,
             interval: float, train_seconds: float, infer_busy: float, rollout_tokens: int, sync: dict[str, float],
             buffer: Any, engines: Any, abort_resubmits: float) -> dict[str, float]:
    """One optimizer step's line of metrics.jsonl, from the learner's metrics and the driver's state."""
    rewards = np.concatenate([g.rewards for g in groups])
    stale = np.concatenate([trained_version - c.versions for g in groups for c in g.completions])
    train_tokens = sum(len(c.prompt_ids) + len(c.token_ids) - 1 for g in groups for c in g.completions)
    nan = float("nan")
    return {
        "step": state.step,
        "policy_version": state.step,
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "mismatch/kl": nan, "mismatch/router_disagreement": nan, "mismatch/probe_version": nan,  # the driver's probe
        "train/rollout_kl": metrics.get("train/rollout_kl", nan),
        "train/router_disagreement": metrics.get("train/router_disagreement", nan),
        "offpolicy/kl": metrics.get("offpolicy/kl", nan),
        "offpolicy/router_disagreement": metrics.get("offpolicy/router_disagreement", nan),
        "offpolicy/stale_fraction": metrics.get("offpolicy/stale_fraction", nan),
        "replay/applied": metrics.get("replay/applied", nan),
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "throughput/rollout_tokens_per_s": rollout_tokens / interval,
        "throughput/train_tokens_per_s": train_tokens / max(train_seconds, 1e-9),
        # not clamped: the learner's time of a step lies inside the driver's interval of it, so a value above 1
        # is a mismeasured train time, shown rather than hidden
        "util/train_busy": train_seconds / interval,
        "util/infer_busy": min(1.0, infer_busy),
        "sync/seconds": sync.get("sync/seconds", 0.0),
        "sync/bytes": sync.get("sync/bytes", 0.0),
        "sync/full_bytes": sync.get("sync/full_bytes", sync.get("sync/bytes", 0.0)),
        "sync/changed_fraction": sync.get("sync/changed_fraction", nan),
        "sync/experts_unchanged": sync.get("sync/experts_unchanged", nan),
        "sync/delta": sync.get("sync/delta", 0.0),
        "eval/reward/mean": state.last_eval,
        "eval/step": float(state.last_eval_step),
        "eval/policy_version": float(state.last_eval_version),
        "reward/failed": float(state.reward_failed),
        "data/bad_rows": float(state.bad_rows),
        "loss": metrics.get("loss", nan),
        "nll": metrics.get("nll", nan),
        "grad_norm": metrics.get("grad_norm", nan),
        "clip_fraction": metrics.get("clip_fraction", nan),
        "ratio_mean": metrics.get("ratio_mean", nan),
        "correction/truncated_fraction": metrics.get("correction/truncated_fraction", nan),
        "correction/masked_fraction": metrics.get("correction/masked_fraction", nan),
        "kl/reference": metrics.get("kl/reference", nan),
        "dynamic_sampling/dropped_groups": float(state.dropped_uniform),
        "response_length/mean": float(np.mean([len(c.token_ids) for g in groups for c in g.completions])),
        "buffer/groups": float(len(buffer)),
        "buffer/dropped_stale": float(buffer.dropped_stale),
        "faults/engine_restarts": float(engines.restarts),
        "faults/requests_resubmitted": float(engines.requests_resubmitted),
        "faults/requests_lost": float(state.requests_lost),
        "faults/steps_skipped": float(state.steps_skipped),
        "faults/sync_failures": float(engines.sync_failures),
        "rollout/resubmitted": abort_resubmits,
        "watch/rollbacks": float(state.rollbacks),
        "watch/discarded_groups": float(state.discarded_groups),
        "learner/lr_scale": float(state.lr_scale),
        "learner/lr": metrics.get("lr", nan),
        "resume/from_step": float(state.resumed_from),
        "resume/requests_resubmitted": float(state.resume_resubmitted),
        "resume/buffered_groups": float(state.resume_buffered_groups),
        "time/step_seconds": interval,
        "time/train_seconds": train_seconds,
    }
