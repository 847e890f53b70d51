"""One Ray actor per Megatron learner rank; together they form one torch.distributed world."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

from moe_grpo.learner.parallel import SECRET_ENV, ranks
from moe_grpo.orchestrator.logs import quiet_libraries
from moe_grpo.sync.dtypes import version_dtype

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig
    from moe_grpo.sync.layout import SyncLayout

KEPT_REPORTS = 8
"""Publish reports a rank keeps: background publishes on different ranks finish at most a version or two apart."""


class LearnerWorker:
    """Holds this rank's `MegatronLearner` and its `WeightSync`; every rank gets the same calls in the same order."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, run: RunConfig,
                 sync: SyncLayout | str,
                 cpus: list[int] | None = None, secret: str = "") -> None:
        """`sync`: the run's `SyncLayout` (or a shared-memory root directory); `secret`: the run's rendezvous
        secret (the driver's; only holders get into the learners' store)."""
        quiet_libraries()
        children_die_with_their_parent()
        # This process's own environment: readable by its user only (/proc/<pid>/environ is 0400).
        from moe_grpo.sync.layout import SyncLayout

        local_rank = sync.local_rank(rank) if isinstance(sync, SyncLayout) else rank  # its index on its own host
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), **{SECRET_ENV: secret})
        import torch

        if cpus:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(max(1, len(cpus) if cpus else int(run.cluster.learner_cpus)))
        from moe_grpo.learner.megatron_learner import MegatronLearner
        from moe_grpo.sync.transports import make_publisher
        from moe_grpo.sync.weight_sync import DeltaOptions, WeightSync

        self.run = run
        self.learner = MegatronLearner(run.model, run.parallel, run.learner, run.megatron,
                                       temperature=run.rollout.temperature, lora=run.lora)
        # Versions travel in the engines' dtype; this rank casts its shards as it writes them.
        self.sync = WeightSync(self.learner, make_publisher(sync, rank),
                               dtype=version_dtype(run.rollout.dtype, run.lora), delta=DeltaOptions.of(run.sync))
        self.loss = run.algo.token_loss(run.rollout.max_tokens)
        self.ranks = ranks()
        self.rank = rank
        self._handle: Any = None
        self._reports: dict[int, dict[str, Any]] = {}
        """Version -> this rank's report of its publish, the latest KEPT_REPORTS finished (`sync_metrics`)."""
        self.lr_scale = 1.0
        """The learning-rate schedule's scale (a rollback or a resumed run's `lr` sets it)."""

    def info(self) -> dict[str, Any]:
        return {**self.ranks, "parameters": sum(p.numel() for p in self.learner.module.parameters()), "pid": os.getpid(),
                "host": socket.gethostname()}

    def load_start_weights(self, megatron_dir: str | None, adapter_dir: str | None) -> None:
        """Before the warm start or a resume: the run's initial weights (`init.megatron`, or `init.hf` converted,
        saved at any layout: Megatron reshards it to this one), then `init.adapter` (a PEFT adapter; every rank
        takes its shard)."""
        from moe_grpo.checkpoint.peft import load_learner_adapter

        if megatron_dir:
            self.learner.load_checkpoint(megatron_dir)
        if adapter_dir:
            load_learner_adapter(self.learner, adapter_dir)

    def warm_start(self, batches: Sequence[Sequence[Any]]) -> list[float]:
        """Supervised steps (advantage 1, no rollout log-probs: the ratio is 1, the gradient is the NLL's).

        Returns each step's mean NLL of the answer tokens. With a KL penalty (`algo.kl_coef > 0`) the weights
        after the warm start become the frozen reference policy (`set_reference`, called by `InitialWeights`)."""
        from moe_grpo.learner.megatron_learner import SUPERVISED_LOSS

        losses = []
        for seqs in batches:
            metrics = self.learner.train_step(list(seqs), replay="off", loss_fn=SUPERVISED_LOSS)
            losses.append(float(metrics["nll"]))
        return losses

    def set_reference(self) -> None:
        """The KL penalty's frozen reference policy: this rank's weights now (a fresh run's, after the warm start)."""
        self.learner.set_reference()

    def train(self, seqs: Sequence[Any], policy_version: int, replay: str) -> dict[str, float]:
        """`algo.mini_batches` optimizer steps on this data-parallel rank's share of the batch (`replay`: r3, r2 or off)."""
        from moe_grpo.learner.megatron_learner import NonFiniteError

        t0 = time.perf_counter()
        lr = self.learner.schedule_lr(policy_version + 1, self.run.steps, self.lr_scale)
        try:
            metrics = self.learner.train_batch(list(seqs), mini_batches=self.run.algo.mini_batches, replay=replay,
                                               loss_fn=self.loss, policy_version=policy_version)
        except NonFiniteError as e:
            return {"skipped": 1.0, "error": str(e), "train_seconds": time.perf_counter() - t0}
        metrics["train_seconds"] = time.perf_counter() - t0
        metrics["lr"] = lr
        return metrics

    def publish(self, version: int, background: bool, snapshot: bool = False) -> None:
        """Write this rank's shards as `version` (in the background: overlapped with the next step); `snapshot`:
        keep a copy of these weights for the mismatch probe of this version (rounded to the version's dtype)."""
        if snapshot:
            self.learner.snapshot_weights(version, self.sync.plan.torch_dtype)  # as the engines hold them
        # WeightSync.sync waits for the publish in flight anyway; waiting here keeps its report (and raises its
        # error before the next publish starts)
        self._collect(wait=True)
        self._handle = self.sync.sync(version, background=background)
        if not background:
            self._collect()

    def probe(self, seqs: Sequence[Any], version: int) -> dict[str, float] | None:
        """The engine-vs-learner gap on `version`'s weights (MegatronLearner.probe); a collective."""
        return self.learner.probe(list(seqs), version)

    def _collect(self, wait: bool = False) -> None:
        """Keep the report of the publish in flight if it is done (`wait`: once it is done)."""
        if self._handle is not None and (wait or self._handle.done()):
            report = self._handle.wait()
            self._reports[report.version] = report.metrics()
            for version in sorted(self._reports)[:-KEPT_REPORTS]:
                del self._reports[version]
            self._handle = None

    def sync_metrics(self) -> dict[int, dict[str, Any]]:
        """Version -> this rank's `sync/*` report, for its latest finished publishes (the driver combines the
        newest version every rank has finished: `sync_metrics.newest_common_version`)."""
        self._collect()
        return dict(self._reports)

    def save_run_state(self, directory: str) -> None:
        """This rank's part of a run checkpoint (weights, optimizer, learning rate, KL reference, RNG); a
        collective: every rank is called. Waits for a background publish still reading the weights."""
        if self._handle is not None:
            self._handle.wait()
        self.learner.save_run_state(directory)

    def load_run_state(self, directory: str, lr: float | None = None) -> int:
        """Load a run checkpoint written at any layout; `lr` replaces the saved learning rate (a rollback lowers
        it). Returns the learner's step count."""
        if self._handle is not None:
            self._handle.wait()
        self.learner.load_run_state(directory)
        if lr is not None:
            self.learner.set_lr(lr)
            self.lr_scale = lr / self.run.learner.lr
        return int(self.learner.step_count)

    def export_version(self, version: int, directory: str) -> str:
        """Rank 0: write a published version as a model directory an engine starts from (with the tokenizer of
        `init.hf` when the run started from a checkpoint).

        With LoRA, a base version (the first one this learner published) becomes the engines' start directory:
        the frozen base, and the version's adapter in `<directory>/adapter` (PEFT format; engines apply it at
        start). An adapter-only version (the final policy) becomes the merged model (base read back from that
        start directory), with its adapter in `<directory>/peft_adapter`."""
        from moe_grpo.rollout.export import export_model_dir

        if self._handle is not None:
            self._handle.wait()
        tensors = self.sync.transport.read_version(version, timeout_s=self.run.cluster.start_timeout_s)
        if not self.run.lora.enabled:
            return str(export_model_dir(self.run.model, tensors, directory, source_dir=self.run.init.hf))
        return str(self._export_lora_version(version, tensors, directory))

    def _export_lora_version(self, version: int, tensors: dict[str, Any], directory: str) -> Any:
        from moe_grpo.rollout.export import export_lora_version

        path, is_base = export_lora_version(self.run.model, self.run.lora, tensors, directory,
                                            base_dir=getattr(self, "_base_dir", None), source_dir=self.run.init.hf)
        if is_base:
            self._base_dir = str(path)
        return path


def children_die_with_their_parent() -> None:
    """Every process forked from here on (and from those) gets SIGKILL when the process that forked it dies.

    megatron-core's checkpoint writer forks a process per write bucket; if this rank is SIGKILLed mid-write they
    are orphaned, wait on their queue forever, and keep this actor's inherited Ray connection open, so Ray never
    learns the rank died. Linux's PR_SET_PDEATHSIG, set in each child right after the fork, ends them with it.
    (Forks happen on the actor's main thread, which lives as long as the process.)"""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    os.register_at_fork(after_in_child=lambda: libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL)))
