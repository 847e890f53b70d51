"""The Megatron-Core learner: per-token log-probs, a policy-gradient step, checkpoints.

One `MegatronLearner` lives in every learner process. All processes of a
layout call the same methods in the same order (they are collectives); each
data-parallel rank passes its own sequences.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import torch

from moe_grpo.algo.corrections import Correction
from moe_grpo.algo.losses import PolicyLoss, TokenLoss
from moe_grpo.learner.batch import LearnerSequence, Microbatch, make_microbatches
from moe_grpo.learner.config import LearnerConfig
from moe_grpo.learner.parallel import ParallelLayout, init_distributed, ranks, seed_everything
from moe_grpo.models.megatron import MegatronOptions, build_gpt_model, transformer_config
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.routing.replay import RoutingReplayer, check_replay_supported, megatron_token_order
from moe_grpo.routing.trace import RoutingTrace


class NonFiniteError(FloatingPointError):
    """A loss or gradient was NaN/inf; the optimizer step was not taken."""


REPLAY_MODES = ("r3", "r2", "off")
"""Routing in the training forward: r3 = the engine's (the rollout trace), r2 = the learner's own, recorded in a
no-grad forward of the batch before the training forward, off = the routers choose freely."""


def replay_mode(replay: bool | str) -> str:
    """`True`/`False` (the older boolean API) or a mode name -> one of `REPLAY_MODES`."""
    if replay is True or replay is False:
        return "r3" if replay else "off"
    if replay not in REPLAY_MODES:
        raise ValueError(f"replay={replay!r}, expected one of {list(REPLAY_MODES)} (or a bool: True = r3)")
    return str(replay)


def default_loss() -> PolicyLoss:
    """GRPO: PPO clip 0.2 on the ratio to the rollout policy, token-level TIS at 2, token-mean."""
    return PolicyLoss(correction=Correction("tis", high=2.0))


SUPERVISED_LOSS = PolicyLoss(correction=Correction("none"))
"""The warm start's loss: token-mean, no correction (without rollout log-probs the ratio is 1 and, with advantage 1,
the gradient is the NLL's)."""


class MegatronLearner:
    """A Megatron GPTModel for one MoE spec, its optimizer, and routing replay."""

    def __init__(
        self,
        spec: MoEModelSpec,
        layout: ParallelLayout = ParallelLayout(),
        config: LearnerConfig = LearnerConfig(),
        options: MegatronOptions = MegatronOptions(),
    ) -> None:
        # Megatron's INFO records list every parameter of every bucket; keep its log to warnings.
        logging.getLogger("megatron").setLevel(logging.WARNING)
        init_distributed(layout)
        seed_everything(config.seed)
        from megatron.core import parallel_state as ps

        from moe_grpo.learner.optimizer import build_ddp_and_optimizer

        self.spec, self.layout, self.config, self.options = spec, layout, config, options
        if (not torch.cuda.is_available() and layout.tensor_parallel > 1 and layout.expert_parallel > 1
                and options.token_dispatcher == "alltoall"):
            raise ValueError(
                f"TP={layout.tensor_parallel} x EP={layout.expert_parallel} on gloo needs the allgather dispatcher "
                "(gloo's all_gather refuses the alltoall dispatcher's uneven sizes); set megatron.token_dispatcher=allgather"
            )
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
        self.model, self.optimizer = build_ddp_and_optimizer(module, self.mconfig, config, options)
        self.replayer = RoutingReplayer(module, spec.moe_layer_pattern, recompute=options.recompute) if options.routing_replay else None
        self.step_count = 0
        self._reference: list[torch.Tensor] | None = None
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
        tp = self.layout.tensor_parallel
        n = len(seqs)
        if n == 0:
            raise ValueError("no sequences given; every data-parallel rank needs at least one")
        if replay:
            from moe_grpo.routing.trace import RoutingTraceError

            for i, s in enumerate(seqs):
                if s.routing is None:
                    continue  # make_microbatches names every sequence without a trace
                try:
                    s.routing.validate(num_positions=s.num_positions, num_moe_layers=self.spec.num_moe_layers,
                                       top_k=self.spec.top_k, num_experts=self.spec.num_experts)
                except RoutingTraceError as e:
                    raise RoutingTraceError(f"sequence {i}: {e}") from e
        mbs = self.config.micro_batch_size
        batches = make_microbatches(
            seqs,
            list(range(n)),
            micro_batch_size=min(mbs, n),
            pad_multiple=tp,
            packed=self.config.packed,
            with_routing=replay if routing is None else (replay or routing),
            moe_layers=self.spec.num_moe_layers,
            top_k=self.spec.top_k,
            seq_len=self.config.packed_seq_len,
        )
        return [mb.to(self.device) for mb in batches]

    def _run(self, microbatches: list[Microbatch], *, replay: bool, forward_only: bool, loss_fn: Any,
             record_free: bool = False, record_used: bool = False,
             targets: list[torch.Tensor] | None = None) -> list[dict[str, Any]]:
        """One pass of Megatron's schedule over `microbatches`.

        `replay`: force each microbatch's rollout trace (`mb.routing`); `targets`: force these ids instead,
        one `[tokens, moe_layers, topk]` tensor per microbatch in Megatron order (r2: the learner's recorded
        routing). Either way every router call must have used them (`ReplayNotAppliedError` otherwise)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if (replay or targets is not None) and self.replayer is None:
            raise ValueError("replay requested but the learner was built with routing_replay=False")
        rep = self.replayer
        if rep is not None:
            rep.clear()
            rep.record_free, rep.record_used = record_free, record_used
        sp_size = self.layout.tensor_parallel if self.layout.sequence_parallel else 1
        index = {id(mb): i for i, mb in enumerate(microbatches)}

        def forward_step(data_iterator: Any, model: Any) -> Any:
            mb: Microbatch = next(data_iterator)
            if rep is not None:
                if targets is not None:
                    rep.set_targets(targets[index[id(mb)]])
                elif replay:
                    rep.set_targets(megatron_token_order(mb.routing, sp_rank=self.rank["tp"], sp_size=sp_size))
                else:
                    rep.free_running()
            rows, width = mb.input_ids.shape
            position_ids = torch.arange(width, device=mb.input_ids.device).unsqueeze(0).expand(rows, -1)
            out = model(mb.input_ids, position_ids, attention_mask=mb.attention_mask, labels=mb.labels)
            return out, partial(loss_fn, mb)

        rows, width = microbatches[0].input_ids.shape
        store = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[self.model],
            num_microbatches=len(microbatches),
            seq_length=width,
            micro_batch_size=rows,
            forward_only=forward_only,
        )
        if rep is not None and (replay or targets is not None):
            rep.require_applied()
        return store if self.is_last_stage else []

    def _broadcast_from_last_stage(self, obj: Any) -> Any:
        from megatron.core import parallel_state as ps

        if self.layout.pipeline_parallel == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                                group=ps.get_pipeline_model_parallel_group())
        return box[0]

    @staticmethod
    def _unpack(store: list[dict[str, Any]], microbatches: list[Microbatch], key: str, n: int) -> list[np.ndarray]:
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * n
        for mb, rec in zip(microbatches, store):
            values = rec[key]
            for idx, row, start, end in mb.spans:
                out[idx] = values[row, start:end].numpy().astype(np.float32)
        return out

    # ------------------------------------------------------------------ API
    @torch.no_grad()
    def logprobs(self, seqs: Sequence[LearnerSequence], *, replay: bool = False) -> list[np.ndarray]:
        """Log-prob of every next token: one array of `len(tokens)-1` per sequence (this DP rank's)."""
        self.model.eval()
        mbs = self._microbatches(seqs, replay)

        def loss_fn(mb: Microbatch, output: torch.Tensor) -> Any:
            return output.sum() * 0.0, {"logprobs": (-output.float()).detach().cpu()}

        store = self._run(mbs, replay=replay, forward_only=True, loss_fn=loss_fn)
        result = self._unpack(store, mbs, "logprobs", len(seqs)) if self.is_last_stage else None
        return self._broadcast_from_last_stage(result)

    @torch.no_grad()
    def routing(self, seqs: Sequence[LearnerSequence], *, replay: bool = False) -> dict[str, Any]:
        """The expert ids every router of this stage used (and would have used free-running).

        Returns `{"used": {moe_index: [b, s, k] per microbatch...}, "free": ...}` in batch order
        for this rank's sequence-parallel slice; tests and the agreement metrics read it.
        """
        from moe_grpo.routing.replay import batch_order_from_megatron

        self.model.eval()
        mbs = self._microbatches(seqs, replay)

        def loss_fn(mb: Microbatch, output: torch.Tensor) -> Any:
            return output.sum() * 0.0, {}

        self._run(mbs, replay=replay, forward_only=True, loss_fn=loss_fn, record_free=True, record_used=True)
        assert self.replayer is not None
        rows = mbs[0].input_ids.shape[0]
        return {
            "used": {s.moe_index: [batch_order_from_megatron(t, rows) for t in s.used] for s in self.replayer.slots},
            "free": {s.moe_index: [batch_order_from_megatron(t, rows) for t in s.free] for s in self.replayer.slots},
            "microbatches": mbs,
        }

    def routing_traces(self, seqs: Sequence[LearnerSequence], *, replay: bool = False) -> dict[str, list[RoutingTrace]]:
        """Per sequence, the routing the learner used and the routing it would choose free-running.

        `{"used": [RoutingTrace...], "free": [...]}`, one trace per sequence
        (`len(tokens) - 1` rows, MoE layers only). With `replay=True`, "used"
        is the replayed trace and "free" is what the current weights prefer,
        so `routing.metrics.agreement(used, free)` is the router disagreement.
        Needs every MoE layer and the whole sequence on this rank (TP = PP = 1).
        """
        if self.layout.tensor_parallel > 1 or self.layout.pipeline_parallel > 1:
            raise ValueError("routing_traces needs TP=PP=1 (all MoE layers and whole sequences on one rank)")
        rec = self.routing(seqs, replay=replay)
        out: dict[str, list[RoutingTrace]] = {"used": [], "free": []}
        spans = {idx: (mb_i, row, start, end) for mb_i, mb in enumerate(rec["microbatches"])
                 for idx, row, start, end in mb.spans}
        for k in range(len(seqs)):
            mb_i, row, start, end = spans[k]
            for key in ("used", "free"):
                ids = torch.stack([rec[key][m][mb_i][row, start:end] for m in range(self.spec.num_moe_layers)], dim=1)
                out[key].append(RoutingTrace.from_array(ids, self.spec.num_experts))
        return out

    def train_step(self, seqs: Sequence[LearnerSequence], *, replay: bool | str = True,
                   global_num_tokens: int | None = None, loss_fn: TokenLoss | None = None,
                   policy_version: int = 0) -> dict[str, float]:
        """Zero gradients, `forward_backward` on this DP rank's sequences, `optimizer_step`."""
        self.zero_grad()
        metrics = self.forward_backward(seqs, replay=replay, global_num_tokens=global_num_tokens, loss_fn=loss_fn,
                                        policy_version=policy_version)
        metrics.update(self.optimizer_step())
        return metrics

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    # ------------------------------------------------------------------ reference policy (KL penalty)
    def set_reference(self) -> None:
        """Freeze a copy of this rank's current weights as the KL penalty's reference policy.

        Costs one more copy of this rank's parameters (in their dtype), and one no-grad forward per step that
        uses it. The copy is swapped into the live parameters for that forward (no second model, so every
        layout and the routing replay work unchanged)."""
        self._reference = [p.detach().clone() for p in self.module.parameters()]

    @property
    def has_reference(self) -> bool:
        return self._reference is not None

    @torch.no_grad()
    def _reference_logprobs(self, mbs: list[Microbatch], *, replay: bool,
                            targets: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Log-probs of every position under the reference weights, routed as the training forward is."""
        assert self._reference is not None
        params = list(self.module.parameters())
        live = [p.data for p in params]
        was_training = self.model.training
        self.model.eval()
        try:
            for p, ref in zip(params, self._reference):
                p.data = ref
            store = self._run(mbs, replay=replay, targets=targets, forward_only=True,
                              loss_fn=lambda mb, output: (output.sum() * 0.0, {"logprobs": (-output.float()).detach()}))
        finally:
            for p, data in zip(params, live):
                p.data = data
            self.model.train(was_training)
        return [rec["logprobs"] for rec in store]

    # ------------------------------------------------------------------ R2: the learner's own routing
    @torch.no_grad()
    def _record_own_routing(self, mbs: list[Microbatch]) -> list[torch.Tensor]:
        """R2: route the batch freely once (no grad) and return, per microbatch, the ids every router of this
        stage chose, as replay targets `[tokens, moe_layers, topk]` in Megatron order (this rank's tokens).

        megatron-core's own `RouterReplayAction.RECORD` keeps only the last call's ids per router, so with
        several microbatches the ids are taken from `RoutingReplayer`'s per-call record instead."""
        assert self.replayer is not None
        was_training = self.model.training
        self.model.eval()
        try:
            self._run(mbs, replay=False, forward_only=True, record_used=True,
                      loss_fn=lambda mb, output: (output.sum() * 0.0, {}))
        finally:
            self.model.train(was_training)
        slots = self.replayer.slots
        if not slots:  # a pipeline stage without MoE layers has nothing to replay
            return [torch.zeros(0, self.spec.num_moe_layers, self.spec.top_k, dtype=torch.int64) for _ in mbs]
        out = []
        for i in range(len(mbs)):
            first = slots[0].used[i]
            ids = torch.zeros(first.shape[0], self.spec.num_moe_layers, first.shape[1], dtype=torch.int64)
            for slot in slots:
                ids[:, slot.moe_index] = slot.used[i].to(torch.int64)
            out.append(ids)
        self.replayer.reset_counters()
        return out

    @staticmethod
    def _segments(mb: Microbatch) -> torch.Tensor:
        """Per position, the index of its sequence within the microbatch; -1 on padding."""
        seg = torch.full(mb.input_ids.shape, -1, dtype=torch.int64, device=mb.input_ids.device)
        for j, (_, row, start, end) in enumerate(mb.spans):
            seg[row, start:end] = j
        return seg

    def forward_backward(self, seqs: Sequence[LearnerSequence], *, replay: bool | str = True,
                         global_num_tokens: int | None = None, loss_fn: TokenLoss | None = None,
                         policy_version: int = 0, global_num_sequences: int | None = None) -> dict[str, float]:
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

        When every sequence carries its rollout trace, the routers' own top-k choices are recorded in the same
        forward (replayed or not) and compared with the trace: `mismatch/router_disagreement`.
        """
        from megatron.core import parallel_state as ps

        mode = replay_mode(replay)
        self.model.train()
        loss_fn = loss_fn if loss_fn is not None else default_loss()
        have_traces = all(s.routing is not None for s in seqs)
        mbs = self._microbatches(seqs, mode == "r3", routing=have_traces)
        dp_size = ps.get_data_parallel_world_size()
        if global_num_tokens is None or global_num_sequences is None:
            local = torch.tensor([sum(float(mb.loss_mask.sum()) for mb in mbs), float(len(seqs))],
                                 dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(local, group=ps.get_data_parallel_group())
            global_num_tokens = int(local[0].item()) if global_num_tokens is None else global_num_tokens
            global_num_sequences = int(local[1].item()) if global_num_sequences is None else global_num_sequences
        if global_num_tokens <= 0:
            raise ValueError("forward_backward got no response tokens to train on (every loss mask is empty)")
        normaliser = getattr(loss_fn, "normaliser", "tokens")
        denominator = global_num_tokens if normaliser == "tokens" else global_num_sequences
        have_old = all(s.old_logprobs is not None for s in seqs)
        targets = self._record_own_routing(mbs) if mode == "r2" else None
        ref = None
        if getattr(loss_fn, "kl_coef", 0.0) > 0:
            if self._reference is None:
                raise ValueError("the loss has a KL penalty (kl_coef > 0) but no reference policy was set; "
                                 "call set_reference() once (after the warm start)")
            ref = self._reference_logprobs(mbs, replay=mode == "r3", targets=targets)
        self.model.train()
        scale = len(mbs) * dp_size / denominator
        stat_keys = tuple(loss_fn.stat_keys)
        mb_index = {id(mb): i for i, mb in enumerate(mbs)}

        def loss(mb: Microbatch, output: torch.Tensor) -> Any:
            logp = -output.float()
            old = mb.old_logprobs if have_old else logp.detach()
            staleness = (float(policy_version) - mb.versions) * mb.loss_mask
            kwargs: dict[str, Any] = {"segments": self._segments(mb)}
            if ref is not None:
                kwargs["ref_logprobs"] = ref[mb_index[id(mb)]].to(logp.device)
            pg_sum, stats = loss_fn(logp, old, mb.advantages, mb.loss_mask, staleness, **kwargs)
            mismatch = torch.zeros((), dtype=torch.float64, device=logp.device)
            if have_old:  # k3 estimator of KL(rollout || learner) on response tokens
                # float64: for |log r| ~ 1e-7 the float32 k3 terms round to exactly zero.
                log_r = (logp.detach().double() - mb.old_logprobs.double()) * mb.loss_mask
                mismatch = ((torch.expm1(log_r) - log_r) * mb.loss_mask).sum()
            nll = -(logp.detach().double() * mb.loss_mask).sum()
            return pg_sum * scale, {"pg_sum": pg_sum.detach(), "k3_sum": mismatch, "nll_sum": nll,
                                    **{k: stats[k].detach() for k in stat_keys}}

        store = self._run(mbs, replay=mode == "r3", targets=targets, forward_only=False, loss_fn=loss,
                          record_free=have_traces)
        keys = ("pg_sum", "k3_sum", "nll_sum") + stat_keys
        local = torch.zeros(len(keys) + 4, dtype=torch.float64, device=self.device)
        if self.is_last_stage and self.rank["tp"] == 0:
            for rec in store:
                local[: len(keys)] += torch.tensor([float(rec[k]) for k in keys], dtype=torch.float64, device=self.device)
        if self.replayer is not None:
            if self.rank["tp"] == 0:
                local[len(keys) : len(keys) + 2] += torch.tensor(
                    [self.replayer.calls, self.replayer.replayed_calls], dtype=torch.float64, device=self.device)
            if have_traces:
                local[len(keys) + 2 :] += torch.tensor(self._router_disagreement(mbs), dtype=torch.float64,
                                                       device=self.device)
        torch.distributed.all_reduce(local)
        sums = dict(zip(keys, local.tolist()))
        calls, replayed, differ, decisions = local[len(keys) :].tolist()
        metrics = {
            "loss": sums["pg_sum"] / denominator,
            "tokens": float(global_num_tokens),
            "sequences": float(global_num_sequences),
            "nll": sums["nll_sum"] / global_num_tokens,
            "replay/applied": replayed / calls if calls else 0.0,
            **{k: sums[k] / global_num_tokens for k in stat_keys},
        }
        if decisions:
            metrics["mismatch/router_disagreement"] = differ / decisions
        if have_old:
            metrics["mismatch/kl"] = sums["k3_sum"] / global_num_tokens
        if not math.isfinite(sums["pg_sum"]):
            self.zero_grad()
            raise NonFiniteError(f"step {self.step_count + 1}: loss={metrics['loss']}; gradients dropped, no update")
        return metrics

    def _router_disagreement(self, mbs: list[Microbatch]) -> tuple[float, float]:
        """(differing, all) (token, MoE layer) decisions of this rank: the routers' free top-k set vs the trace."""
        assert self.replayer is not None
        sp_size = self.layout.tensor_parallel if self.layout.sequence_parallel else 1
        differ = total = 0.0
        for i, mb in enumerate(mbs):
            valid = torch.zeros(mb.input_ids.shape, dtype=torch.int64)
            for _, row, start, end in mb.spans:
                valid[row, start:end] = 1
            valid = megatron_token_order(valid[:, :, None, None], sp_rank=self.rank["tp"], sp_size=sp_size)[:, 0, 0]
            want = megatron_token_order(mb.routing.cpu(), sp_rank=self.rank["tp"], sp_size=sp_size)
            for slot in self.replayer.slots:
                if i >= len(slot.free):
                    continue
                free = torch.sort(slot.free[i].to(torch.int64), -1).values
                same = (free == torch.sort(want[:, slot.moe_index], -1).values).all(-1)
                differ += float(((~same) & (valid > 0)).sum())
                total += float(valid.sum())
        return differ, total

    def optimizer_step(self) -> dict[str, float]:
        """Apply the accumulated gradients, unless any is NaN/inf on any rank (then raise, weights unchanged)."""
        for wait in self.before_update:
            wait()
        grads_finite = torch.tensor([1.0 if self._grads_finite() else 0.0], device=self.device)
        torch.distributed.all_reduce(grads_finite, op=torch.distributed.ReduceOp.MIN)
        if grads_finite.item() < 1.0:
            self.zero_grad()
            raise NonFiniteError(
                f"step {self.step_count + 1}: non-finite gradient on at least one rank; "
                "optimizer step skipped, weights unchanged"
            )
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise NonFiniteError(f"step {self.step_count + 1}: Megatron's optimizer refused the update")
        self.step_count += 1
        return {"grad_norm": float(grad_norm), "step": float(self.step_count)}

    def _grads_finite(self) -> bool:
        for buffer in list(self.model.buffers) + list(self.model.expert_parallel_buffers):
            if not bool(torch.isfinite(buffer.grad_data).all()):
                return False
        return True

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str) -> None:
        """Megatron distributed checkpoint of the weights, written to a temp dir and renamed into place."""
        from megatron.core import dist_checkpointing

        rank = torch.distributed.get_rank()
        tmp = directory.rstrip("/") + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        torch.distributed.barrier()
        dist_checkpointing.save(self.module.sharded_state_dict(), tmp)
        torch.distributed.barrier()
        if rank == 0:
            from moe_grpo.checkpoint.convert import write_spec

            write_spec(self.spec, tmp)  # the checkpoint describes its model: export needs no config
            old = directory.rstrip("/") + ".old"
            if os.path.exists(directory):
                os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        torch.distributed.barrier()

    def load_checkpoint(self, directory: str) -> None:
        """Load weights saved at any TP/EP/PP layout into this layout."""
        from megatron.core import dist_checkpointing

        if not os.path.isdir(directory):
            raise FileNotFoundError(f"no Megatron checkpoint at {directory!r}")
        state = dist_checkpointing.load(self.module.sharded_state_dict(), directory)
        self.module.load_state_dict(state)
