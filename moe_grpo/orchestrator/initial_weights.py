"""What the learner ranks do before the engines start: the warm start (a fresh run) or loading the checkpoint (a
resumed one), then the first version the engines start from."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_grpo.checkpoint import hf_init
from moe_grpo.data.tasks import supervised_sequences
from moe_grpo.orchestrator.learner_group import LearnerGroup
from moe_grpo.orchestrator.probe import probe_due
from moe_grpo.orchestrator.state import RunState

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig

log = logging.getLogger("moe_grpo")


def warm_start(run: RunConfig, learners: LearnerGroup, tokenizer: Any, source: Any) -> list[float]:
    """`run.warm_start` supervised steps on the task's answers (one learner call); the answer NLL of each."""
    from moe_grpo.learner.batch import LearnerSequence

    batches = []
    for _ in range(run.warm_start):
        pairs = supervised_sequences(source.take(run.algo.prompts_per_step), tokenizer)
        batches.append([LearnerSequence(np.asarray(t), prompt_len=p, advantage=1.0) for t, p in pairs])
    if not batches:
        return []
    per_batch = [learners.split(b) for b in batches]  # each batch's shares, rank order
    shares = [[shares_of_batch[rank] for shares_of_batch in per_batch] for rank in range(len(learners))]
    # One call runs every warm-start step: each step gets the limit of a training step.
    return learners.call("warm_start", shares=shares, what=f"the warm start ({len(batches)} supervised steps)",
                         timeout_s=learners.timeout_s * len(batches))[0]


@dataclasses.dataclass
class InitialWeights:
    """What the learner ranks do before the engines start: warm start (fresh run) or load (resume), then publish
    the weights the engines start from and write the model directory they load."""

    run: RunConfig
    run_dir: str
    tokenizer: Any
    source: Any
    state: RunState
    resume_from: Path | None = None
    start_checkpoint: hf_init.LearnerStartCheckpoint | None = None
    """The Megatron checkpoint of `init.hf` (converted while the ranks started); None: `init.megatron` or none."""

    def __call__(self, learners: LearnerGroup) -> str:
        t0 = time.perf_counter()
        megatron = self.start_checkpoint.path() if self.start_checkpoint is not None else self.run.init.megatron
        if megatron or self.run.init.adapter:
            learners.call("load_start_weights", megatron, self.run.init.adapter,
                          what=f"loading the initial weights ({megatron or self.run.init.adapter})")
        if self.resume_from is not None:
            lr = self.run.learner.lr * self.state.lr_scale
            learners.call("load_run_state", str(self.resume_from / "learner"), lr,
                          what=f"loading {self.resume_from.name}")
            version = self.state.step
            log.info("resume: learner state of step %d loaded in %.1f s", version, time.perf_counter() - t0)
        else:
            version = 0
            self.state.warm_start_loss = warm_start(self.run, learners, self.tokenizer, self.source)
            warm = self.state.warm_start_loss
            if warm:
                log.info("warm start: %d supervised steps in %.1fs, answer NLL %.3f -> %.3f", len(warm),
                         time.perf_counter() - t0, warm[0], warm[-1])
            if self.run.algo.kl_coef > 0:  # a resumed run restores its reference with the run state
                learners.call("set_reference", what="keeping the KL penalty's reference weights")
        # The first half of `Driver.push_version` (the driver and its engines come once this returns).
        self.state.published = version
        learners.publish(version, background=False, snapshot=probe_due(self.run, version))
        if self.run.init.hf and not self.state.warm_start_loss and self.resume_from is None and not self.run.lora.enabled:
            return str(hf_init.engine_dir(self.run.init.hf, self.run.model, os.path.join(self.run_dir, "model_v0")))
        model_dir = os.path.join(self.run_dir, f"model_v{version}")
        exported = learners.call("export_version", version, model_dir, what=f"exporting version {version}", ranks=1)[0]
        drop_older_exports(self.run_dir, keep=exported)
        return exported


def drop_older_exports(run_dir: str, keep: str) -> list[str]:
    """Remove the engines' start directories (`model_v<N>/`) of this run's earlier starts: each resume exports the
    version it resumes at, a whole model, and no engine of this start reads an older one (they stayed, one model's
    size per preemption: a user's trial, 2026-11-28). Returns the names removed."""
    removed = []
    for entry in sorted(Path(run_dir).glob("model_v*")):
        if entry.is_dir() and not entry.is_symlink() and entry.resolve() != Path(keep).resolve() and \
                entry.name[len("model_v"):].isdigit():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    if removed:
        log.info("removed the engines' start directories of earlier starts of this run: %s", ", ".join(removed))
    return removed
