"""The Megatron-Core learner: per-token log-probs, a policy-gradient step, checkpoints.

One `MegatronLearner` lives in every learner process. All processes of a layout call the same methods in the same
order (they are collectives); each data-parallel rank passes its own sequences. The class holds the run state
(weights, optimizer, step count, learning rate, KL reference) and composes the modules that do each job:

    forward_pass.py     one pass of Megatron's schedule over a rank's microbatches (`RankModel`)
    policy_step.py      the loss's forward and backward, normalised over the whole step, and its metrics
    routing_record.py   R2's recorded routing, the routers' ids per microbatch and per sequence
    rollout_gap.py      k3 KL estimate and router disagreement between the rollout and a forward
    kl_reference.py     the KL penalty's reference weights and their forward
    probe_copies.py     the weights of published versions and the mismatch probe scored with them
    checkpoint_io.py    weights and run-state checkpoints (checkpoint_files.py checks their files first)
    rng_state.py        every generator of the process, saved per rank
    lora.py             the LoRA adapters and their PEFT form
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import torch

from moe_grpo.algo.losses import TokenLoss
from moe_grpo.learner import checkpoint_io, policy_step, routing_record
from moe_grpo.learner.batch import LearnerSequence, Microbatch
from moe_grpo.learner.checkpoint_files import IncompleteCheckpointError  # noqa: F401 - raised by the loads; named here
from moe_grpo.learner.config import LearnerConfig
from moe_grpo.learner.forward_pass import (RankModel, from_last_stage, keep_logprobs, microbatches, run_schedule,
                                           unpack)
from moe_grpo.learner.kl_reference import copy_weights
from moe_grpo.learner.lora import apply_lora, gather_adapter_state, load_adapter_state
from moe_grpo.learner.lora_config import LoraConfig
from moe_grpo.learner.optimizer import build_ddp_and_optimizer, current_lr, lr_scheduler, set_lr
from moe_grpo.learner.parallel import ParallelLayout, init_distributed, ranks, seed_everything
from moe_grpo.learner.policy_step import (REPLAY_MODES, SUPERVISED_LOSS, NonFiniteError,  # noqa: F401 - callers'
                                          default_loss, grads_finite, replay_mode)
from moe_grpo.learner.probe_copies import MAX_SNAPSHOTS, ProbeCopies, probe_gap  # noqa: F401 - MAX_SNAPSHOTS: callers'
from moe_grpo.learner.rng_state import restore_rng_state
from moe_grpo.models.megatron import MegatronOptions, build_gpt_model, transformer_config
from moe_grpo.models.options import gloo_dispatcher_problem
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.routing.replay import RoutingReplayer, check_replay_supported
from moe_grpo.routing.trace import RoutingTrace


def _divide_logits(module: Any, args: Any, output: Any, *, temperature: float) -> Any:
    """Forward hook on the output layer: logits / temperature (Megatron's output layer returns (logits, bias))."""
    logits, bias = output
    return logits / temperature, bias


def _check_settings(layout: ParallelLayout, options: MegatronOptions, temperature: float) -> None:
    """Refuse what this learner cannot run, naming the setting."""
    problem = gloo_dispatcher_problem(layout.tensor_parallel, layout.expert_parallel, options.token_dispatcher)
    if problem and not torch.cuda.is_available():
        raise ValueError(problem)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature={temperature}, expected a finite number > 0 (the engines' sampling "
                         "temperature; greedy evaluation trains nothing)")


class MegatronLearner:
    """A Megatron GPTModel for one MoE spec, its optimizer, and routing replay."""

    def __init__(
        self,
        spec: MoEModelSpec,
        layout: ParallelLayout = ParallelLayout(),
        config: LearnerConfig = LearnerConfig(),
        options: MegatronOptions = MegatronOptions(),
        temperature: float = 1.0,
        lora: LoraConfig = LoraConfig(),
    ) -> None:
        """`temperature`: the engines' sampling temperature; every log-prob the learner computes (and so the loss)
        is of the distribution they sample from, softmax(logits / temperature), as verl's and TRL's actors do.
        `lora`: with `lora.rank > 0` the base weights are frozen and only low-rank adapters train
        (learner/lora.py); the router stays frozen and its expert-bias update is switched off."""
        # Megatron's INFO records list every parameter of every bucket; keep its log to warnings.
        logging.getLogger("megatron").setLevel(logging.WARNING)
        init_distributed(layout)
        seed_everything(config.seed)
        from megatron.core import parallel_state as ps

        self.spec, self.layout, self.config, self.options = spec, layout, config, options
        _check_settings(layout, options, temperature)
        self.mconfig = transformer_config(spec, options, layout.megatron_kwargs(spec.num_layers, spec.num_experts,
                                                                                 options.dtype))
        if options.routing_replay:
            check_replay_supported(self.mconfig)
        self.rank = ranks()
        self.is_first_stage = ps.is_pipeline_first_stage()
        self.is_last_stage = ps.is_pipeline_last_stage()
        module = build_gpt_model(
            spec, self.mconfig, pre_process=self.is_first_stage, post_process=self.is_last_stage, pp_rank=self.rank["pp"]
        )
        self.temperature = float(temperature)
        if temperature != 1.0 and self.is_last_stage:
            module.output_layer.register_forward_hook(partial(_divide_logits, temperature=self.temperature))
        self.lora = lora
        self.adapters: dict[str, Any] = {}
        """{global module name: LoraAdapter} of this rank (empty without LoRA)."""
        if lora.enabled:
            self.adapters = apply_lora(module, spec, lora, seed=config.seed)
            # The frozen router's aux-loss-free bias would still move with the load (finalize_model_grads).
            self.mconfig.moe_router_bias_update_rate = 0.0
        self.model, self.optimizer = build_ddp_and_optimizer(module, self.mconfig, config, options)
        self.replayer = (RoutingReplayer(module, spec.moe_layer_pattern, recompute=options.recompute)
                         if options.routing_replay else None)
        self.rank_model = RankModel(model=self.model, replayer=self.replayer, spec=spec, config=config, layout=layout,
                                    rank=self.rank, is_last_stage=self.is_last_stage, device=self.device)
        """What every forward pass reads (forward_pass.py)."""
        self.step_count = 0
        self._reference: list[torch.Tensor] | None = None
        """The KL penalty's reference weights (`set_reference`); run state."""
        self._scheduler: tuple[int, Any] | None = None
        """(total steps, Megatron's OptimizerParamScheduler), built by the first `schedule_lr`."""
        self.probe_copies = ProbeCopies()
        """Published versions kept for `probe` (weights as published)."""
        self.before_update: list[Callable[[], None]] = []
        """Called before the optimizer changes the weights (a background weight sync still copying them waits here)."""

    # ------------------------------------------------------------------ helpers
    @property
    def module(self) -> Any:
        """The bare GPTModel (this stage's layers)."""
        return self.model.module

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _microbatches(self, seqs: Sequence[LearnerSequence], replay: bool,
                      routing: bool | None = None) -> list[Microbatch]:
        return microbatches(self.rank_model, seqs, replay, routing)

    def _run(self, microbatches: list[Microbatch], **kwargs: Any) -> list[dict[str, Any]]:
        """`forward_pass.run_schedule` on this learner's model."""
        return run_schedule(self.rank_model, microbatches, **kwargs)

    def _record_own_routing(self, mbs: list[Microbatch]) -> list[torch.Tensor]:
        """R2's replay targets: `routing_record.record_own_routing` on this learner's model."""
        return routing_record.record_own_routing(self.rank_model, mbs)

    def _wait_for_readers(self) -> None:
        for wait in self.before_update:
            wait()

    # ------------------------------------------------------------------ API
    @torch.no_grad()
    def logprobs(self, seqs: Sequence[LearnerSequence], *, replay: bool = False) -> list[np.ndarray]:
        """Log-prob of every next token: one array of `len(tokens)-1` per sequence (this DP rank's)."""
        self.model.eval()
        mbs = self._microbatches(seqs, replay)
        store = self._run(mbs, replay=replay, forward_only=True, loss_fn=keep_logprobs)
        result = unpack(store, mbs, "logprobs", len(seqs)) if self.is_last_stage else None
        return from_last_stage(self.rank_model, result)

    def routing(self, seqs: Sequence[LearnerSequence], *, replay: bool = False) -> dict[str, Any]:
        """The expert ids every router of this stage used (and would have used free-running).

        Returns `{"used": {moe_index: [b, s, k] per microbatch...}, "free": ...}` in batch order
        for this rank's sequence-parallel slice; tests and the agreement metrics read it.
        """
        return routing_record.routing_ids(self.rank_model, seqs, replay=replay)

    def routing_traces(self, seqs: Sequence[LearnerSequence], *, replay: bool = False) -> dict[str, list[RoutingTrace]]:
        """Per sequence, the routing the learner used and the routing it would choose free-running.

        `{"used": [RoutingTrace...], "free": [...]}`, one trace per sequence
        (`len(tokens) - 1` rows, MoE layers only). With `replay=True`, "used"
        is the replayed trace and "free" is what the current weights prefer,
        so `routing.metrics.agreement(used, free)` is the router disagreement.
        Needs every MoE layer and the whole sequence on this rank (TP = PP = 1).
        """
        return routing_record.routing_traces(self.rank_model, seqs, replay=replay)

    def train_step(self, seqs: Sequence[LearnerSequence], *, replay: bool | str = True,
                   global_num_tokens: int | None = None, loss_fn: TokenLoss | None = None,
                   policy_version: int = 0, r2_targets: list[torch.Tensor] | None = None) -> dict[str, float]:
        """Zero gradients, `forward_backward` on this DP rank's sequences, `optimizer_step`."""
        self.zero_grad()
        metrics = self.forward_backward(seqs, replay=replay, global_num_tokens=global_num_tokens, loss_fn=loss_fn,
                                        policy_version=policy_version, r2_targets=r2_targets)
        metrics.update(self.optimizer_step())
        return metrics

    def train_batch(self, seqs: Sequence[LearnerSequence], *, mini_batches: int = 1, replay: bool | str = True,
                    loss_fn: TokenLoss | None = None, policy_version: int = 0) -> dict[str, float]:
        """`mini_batches` optimizer steps on this DP rank's share of one batch, split into that many contiguous
        parts (verl's ppo_mini_batch_size = the batch / `mini_batches`; every DP rank takes the same number of
        steps). Each step's loss is against the rollout log-probs, so the later steps are off-policy to the
        weights the earlier ones moved: the clip bounds how far.

        With 'r2' every part's routing is recorded before the first step, with the weights the batch started
        from, and replayed in each step (verl's R2: the old-log-prob forward's routing); r2 re-recorded per step
        would be routing 'off' in all but name. Returns the parts' mean metrics, `grad_norm` included, and
        `step` after the last. A non-finite part stops there (the earlier parts' updates stand)."""
        seqs = list(seqs)
        if mini_batches < 1 or len(seqs) < mini_batches:
            raise ValueError(f"mini_batches={mini_batches} for {len(seqs)} sequences on this rank; expected "
                             f"1 <= mini_batches <= the sequences each data-parallel rank trains on")
        if mini_batches == 1:
            return self.train_step(seqs, replay=replay, loss_fn=loss_fn, policy_version=policy_version)
        bounds = np.linspace(0, len(seqs), mini_batches + 1).round().astype(int)
        parts = [seqs[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        targets: list[list[torch.Tensor] | None] = [None] * len(parts)
        if replay_mode(replay) == "r2":
            targets = [self._record_own_routing(self._microbatches(p, False, routing=all(s.routing is not None
                                                                                          for s in p)))
                       for p in parts]
        runs = [self.train_step(p, replay=replay, loss_fn=loss_fn, policy_version=policy_version, r2_targets=t)
                for p, t in zip(parts, targets)]
        keys = set.intersection(*(set(m) for m in runs))
        out = {k: float(np.mean([m[k] for m in runs])) for k in keys}
        out.update(step=runs[-1]["step"], tokens=sum(m["tokens"] for m in runs),
                   sequences=sum(m["sequences"] for m in runs))
        return out

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def forward_backward(self, seqs: Sequence[LearnerSequence], *, replay: bool | str = True,
                         global_num_tokens: int | None = None, loss_fn: TokenLoss | None = None,
                         policy_version: int = 0, global_num_sequences: int | None = None,
                         r2_targets: list[torch.Tensor] | None = None) -> dict[str, float]:
        """Accumulate gradients of the policy loss; no optimizer step.

        `replay`: 'r3' (or True) replays each sequence's rollout trace, 'r2' replays the routing this learner
        chose in a no-grad forward of the same batch just before (one more forward), 'off' (or False) lets the
        routers choose. The loss (`loss_fn`, default `default_loss()`) returns a numerator per microbatch that is
        divided by the response tokens (`global_num_tokens`) or the sequences (`global_num_sequences`) of the
        whole step across DP ranks, as its `normaliser` says (all-reduced when None), so gradients do not depend
        on how sequences are split into microbatches, ranks or calls. Sequences without rollout log-probs are
        trained on as their own sampling policy (ratio 1: with advantage 1 that is supervised fine-tuning).
        `policy_version` is the version these weights will publish; with each sequence's `versions` it gives
        the loss every token's staleness. A loss with `kl_coef > 0` needs `set_reference()` first.

        Metrics of the gap between the rollout and this forward, on the trained tokens: `train/rollout_kl` (k3
        estimate of KL(rollout || learner)) and, when every sequence carries its rollout trace (the routers' own
        top-k choices are recorded in the same forward, replayed or not), `train/router_disagreement`. In async
        runs most of that gap is policy drift (tokens sampled by older weights), so the same two are also given
        over the stale sequences alone (`offpolicy/kl`, `offpolicy/router_disagreement`; a sequence is stale when
        any of its tokens was sampled before `policy_version`) with `offpolicy/stale_fraction` of the tokens. The
        engine-vs-learner gap on the same weights is measured by `probe` instead.
        """
        metrics = policy_step.forward_backward(
            self.rank_model, seqs, mode=replay_mode(replay), loss_fn=loss_fn if loss_fn is not None else default_loss(),
            policy_version=policy_version, global_num_tokens=global_num_tokens,
            global_num_sequences=global_num_sequences, r2_targets=r2_targets, reference=self._reference)
        if not math.isfinite(metrics["loss"]):
            self.zero_grad()
            raise NonFiniteError(f"loss={metrics['loss']}; gradients dropped, no update")
        return metrics

    def optimizer_step(self) -> dict[str, float]:
        """Apply the accumulated gradients, unless any is NaN/inf on any rank (then raise, weights unchanged)."""
        self._wait_for_readers()
        finite = torch.tensor([1.0 if grads_finite(self.model) else 0.0], device=self.device)
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if finite.item() < 1.0:
            self.zero_grad()
            raise NonFiniteError(
                "non-finite gradient on at least one rank; optimizer step skipped, weights unchanged")
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise NonFiniteError("Megatron's optimizer refused the update")
        self.step_count += 1
        return {"grad_norm": float(grad_norm), "step": float(self.step_count)}

    # ------------------------------------------------------------------ reference policy (KL penalty)
    def set_reference(self) -> None:
        """Freeze a copy of this rank's current weights as the KL penalty's reference policy.

        Costs one more copy of this rank's parameters (in their dtype), and one no-grad forward per step that
        uses it. The copy is swapped into the live parameters for that forward (no second model, so every
        layout and the routing replay work unchanged)."""
        self._reference = copy_weights(self.module)

    @property
    def has_reference(self) -> bool:
        return self._reference is not None

    # ------------------------------------------------------------------ the mismatch probe
    def snapshot_weights(self, version: int, dtype: torch.dtype | None = None) -> None:
        """Keep a copy of the weights being published as `version`, for `probe` once an engine serves it (the
        learner trains on meanwhile). At most `MAX_SNAPSHOTS` are kept, the oldest dropped first. `dtype`: what
        the version travels in; the copy holds the weights rounded to it (in the learner's dtype), as the engines
        hold them, so the probe measures the engine-vs-learner gap on the same weights."""
        self.probe_copies.keep(version, self.module, dtype)

    def probe(self, seqs: Sequence[LearnerSequence], version: int) -> dict[str, float] | None:
        """The engine-vs-learner gap on the same weights: score `seqs` (sampled by an engine serving `version`,
        with their rollout log-probs and traces) with the weights published as `version`, routing replayed (R3)
        and free. Returns `kl_replay_on`, `kl_replay_off` (k3 estimates of KL(rollout || learner) over the
        response tokens) and `router_disagreement` (the free routers' top-k vs the engine's trace), or None when
        that version's snapshot is gone (a newer one replaced it). Every rank passes the same sequences."""
        weights = self.probe_copies.take(version)
        return None if weights is None else probe_gap(self.rank_model, weights, seqs)

    # ------------------------------------------------------------------ learning rate
    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses (`learner.lr` until `set_lr` or a loaded run state)."""
        return current_lr(self.optimizer, self.config.lr)

    def schedule_lr(self, step: int, total_steps: int, scale: float = 1.0) -> float:
        """Set the learning rate of RL step `step` (1-based) of a run of `total_steps`, as `learner.lr_warmup_steps`,
        `learner.lr_decay` and `learner.min_lr` say (Megatron's OptimizerParamScheduler), times `scale` (the
        collapse guard's rollbacks lower it); returns it. A function of its arguments only, so a resumed run (its
        step and scale come from the run checkpoint) continues the same schedule. Local: call it on every rank."""
        for group in self.optimizer.param_groups:  # Megatron reads the peak and the floor from each group
            group["max_lr"] = self.config.lr * scale
            group["min_lr"] = self.config.min_lr * scale
        if self._scheduler is None or self._scheduler[0] != total_steps:
            self._scheduler = (total_steps, lr_scheduler(self.optimizer, self.config, total_steps))
        scheduler = self._scheduler[1]
        scheduler.num_steps = step
        scheduler.step(0)
        return self.lr

    def set_lr(self, lr: float) -> None:
        """Change the learning rate of every param group (dense and expert optimizers alike) from the next step on;
        a rollback multiplies it by a factor. Saved with the run state. Local: call it on every rank."""
        set_lr(self.optimizer, float(lr))

    # ------------------------------------------------------------------ checkpoints (checkpoint_io.py)
    def save_checkpoint(self, directory: str) -> None:
        """Megatron distributed checkpoint of the weights, written to a temp dir and renamed into place."""
        checkpoint_io.save_weights(self.module, self.spec, directory)

    def load_checkpoint(self, directory: str) -> None:
        """Load weights saved at any TP/EP/PP layout into this layout (a `save_checkpoint` directory, or the
        `dist` folder of a `save_run_state` directory). A base model's checkpoint leaves the adapters as they are."""
        state, without_adapters = checkpoint_io.read_weights(self.module, directory, has_adapters=bool(self.adapters))
        self._wait_for_readers()
        checkpoint_io.set_weights(self.module, state, without_adapters=without_adapters, directory=directory)
        # bf16 weights or the distributed optimizer keep fp32 main copies, written back over the weights at each
        # step: they must take the loaded values (megatron-core's rule for weights changed outside the optimizer).
        self.optimizer.reload_model_params()

    def save_run_state(self, directory: str) -> None:
        """Collective: everything this learner needs to continue (weights, optimizer state, RNG states, the KL
        reference, step count, learning rate), written into `directory`; `checkpoint_io.save_run_state` lists the
        files."""
        record = checkpoint_io.RunStateRecord(layout=self.layout, step_count=self.step_count, lr=self.lr,
                                              params_dtype=self.options.dtype)
        checkpoint_io.save_run_state(directory, self.module, self.optimizer, self.spec, self._reference, record)

    def load_run_state(self, directory: str) -> None:
        """Collective: continue from a `save_run_state` directory, saved at this or any other TP/EP/PP layout.

        Restores the weights, the optimizer state (or a fresh one when the checkpoint was taken before the first
        step), the KL reference (or none), `step_count` and the learning rate. RNG states are restored only when
        the checkpoint's layout and world size equal this one's (otherwise the generators stay as seeded and rank 0
        logs why). Every file is checked before anything changes: a missing, truncated or unreadable one raises
        `IncompleteCheckpointError` naming it. After a failure inside Megatron's load the learner is undefined;
        load another checkpoint before training on."""
        loaded = checkpoint_io.load_run_state(directory, self.module, self.optimizer, self.spec, self.layout,
                                              before_update=self._wait_for_readers)
        self._reference = loaded.reference
        self.step_count = int(loaded.meta["step_count"])
        self.set_lr(float(loaded.meta["lr"]))
        self.zero_grad()
        if loaded.rng is not None:
            restore_rng_state(loaded.rng)
        elif torch.distributed.get_rank() == 0:
            logging.getLogger(__name__).warning(
                "learner run state %s was saved at %s and is loaded at %s: RNG states not restored (they are per "
                "rank of that layout); the generators stay as seeded", directory, loaded.meta["layout"],
                checkpoint_io.layout_record(self.layout))
        torch.distributed.barrier()

    # ------------------------------------------------------------------ LoRA adapters in PEFT's format (lora.py)
    def adapter_state(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model's adapters as full tensors in PEFT's naming (every rank gets them)."""
        if not self.lora.enabled:
            raise ValueError("this learner has no adapters (lora.rank=0)")
        return gather_adapter_state(self.adapters, self.spec, self.lora)

    def set_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the adapters from full tensors in PEFT's naming (what `adapter_state` gives); every rank takes its
        shard. `checkpoint/peft.py`'s `load_learner_adapter` reads them from a PEFT adapter directory."""
        if not self.lora.enabled:
            raise ValueError("this learner has no adapters (lora.rank=0)")
        self._wait_for_readers()
        load_adapter_state(self.adapters, state, self.spec, self.lora)
        self.optimizer.reload_model_params()  # the adapters' fp32 main copies, as in `load_checkpoint`
