"""What `train` returns: the run's closing summary (`python -m moe_grpo.train` prints its last line from it)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_grpo.orchestrator.engine_pool import EnginePool
from moe_grpo.orchestrator.state import RunState


@dataclass(frozen=True)
class Faults:
    """The faults the run survived, each a count (the closing line names those above 0, in this order)."""

    requests_lost: int
    """Requests whose engine failed and that were given up on (`RunState.requests_lost`)."""
    steps_skipped: int
    """Optimizer steps skipped for a non-finite loss or gradient."""
    sync_failures: int
    """Weight versions an engine failed to load (each restarts it)."""
    engine_restarts: int
    """Engine actors started again after a failure."""
    requests_resubmitted: int
    """Requests sent again to another engine after theirs failed."""
    rollbacks: int
    """Rollbacks by the collapse guard (`routing.on_jump=rollback`)."""


@dataclass(frozen=True)
class RunSummary:
    """The run as it ended. `as_dict()` is what `train` returns (callers index it by these names)."""

    steps: int
    """Optimizer steps taken (of this run and the ones it resumed)."""
    resumed_from: int | None
    """The step of the checkpoint this process resumed from; None for a fresh run."""
    eval_start: float
    """The first held-out reward measured (step 0's; a resumed run keeps its checkpoint's); NaN when none was."""
    eval_end: float
    """The last held-out reward measured; NaN when none was."""
    evals: list[tuple[int, float]]
    """Every held-out reward measured, as (step, reward)."""
    warm_start_loss: list[float]
    """The warm start's answer NLL per supervised step; empty without a warm start (or on resume)."""
    seconds: float
    """Wall-clock seconds of `train`, start-up and cleanup included."""
    run_dir: str
    """The run directory, resolved."""
    policy_dir: str
    """Where the final policy is exported (`run_dir/policy`; absent when the run was stopped)."""
    reward_failed: int
    """Completions whose reward call failed or timed out (scored 0)."""
    bad_rows: int
    """Prompt rows that failed the task's checks and were skipped."""
    stopped: str | None
    """The signal that stopped the run after its checkpoint ('SIGTERM'), or None when the run finished."""
    sync: dict[str, Any]
    """What each sync host under the relay received (`sync_hosts.relay_report`); empty on one host."""
    checkpoint: str | None
    """The newest run checkpoint written or resumed from, or None."""
    faults: Faults
    """The faults the run survived."""
    mismatch: dict[str, float]
    """The newest finished mismatch probe: the run record's `mismatch/*` keys (`MismatchProbe.row`) without the
    prefix ('kl', 'probe_version', ...). In a finished run, measured after waiting for the rounds in progress at the
    end (`Driver.finish_probes`); NaN without a probe."""

    @classmethod
    def of(cls, state: RunState, engines: EnginePool, last_checkpoint: Path | None, *, run_dir: str,
           seconds: float, stopped: str | None, sync: dict[str, Any], mismatch: dict[str, float]) -> RunSummary:
        nan = float("nan")
        return cls(steps=state.step, resumed_from=state.resumed_from if state.resumed_from >= 0 else None,
                   eval_start=state.evals[0][1] if state.evals else nan,
                   eval_end=state.evals[-1][1] if state.evals else nan, evals=state.evals,
                   warm_start_loss=state.warm_start_loss, seconds=seconds, run_dir=run_dir,
                   policy_dir=os.path.join(run_dir, "policy"), reward_failed=state.reward_failed,
                   bad_rows=state.bad_rows, stopped=stopped, sync=sync,
                   mismatch={k.removeprefix('mismatch/'): v for k, v in mismatch.items()},
                   checkpoint=str(last_checkpoint) if last_checkpoint else None,
                   faults=Faults(requests_lost=state.requests_lost, steps_skipped=state.steps_skipped,
                                 sync_failures=engines.sync_failures, engine_restarts=engines.restarts,
                                 requests_resubmitted=engines.requests_resubmitted, rollbacks=state.rollbacks))

    def as_dict(self) -> dict[str, Any]:
        """The summary as a dict: these fields by name, `faults` a dict of its counts (the same objects, not copies:
        `evals` is the run state's list, as `train` returned it before the summary was a dataclass)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["faults"] = {f.name: getattr(self.faults, f.name) for f in dataclasses.fields(self.faults)}
        return out
