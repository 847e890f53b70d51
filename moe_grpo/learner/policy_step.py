"""The policy-gradient step's forward and backward on one rank: how the loss is normalised across the whole step,
the per-microbatch loss with its statistics, and the metrics of the gap between the rollout and this forward.
No optimizer step here (`MegatronLearner.optimizer_step` takes it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from moe_grpo.algo.corrections import Correction
from moe_grpo.algo.losses import PolicyLoss, TokenLoss
from moe_grpo.learner.batch import LearnerSequence, Microbatch
from moe_grpo.learner.forward_pass import LossFn, RankModel, microbatches, run_schedule
from moe_grpo.learner.kl_reference import reference_logprobs
from moe_grpo.learner.rollout_gap import k3, router_disagreement
from moe_grpo.learner.routing_record import record_own_routing


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

STEP_SUMS = ("pg_sum", "k3_sum", "nll_sum", "k3_stale_sum", "stale_tokens")
"""What every microbatch's loss record sums for the step's metrics (besides the loss's own `stat_keys`)."""


def stale_positions(mb: Microbatch, policy_version: int) -> torch.Tensor:
    """1.0 on every position of the microbatch's sequences that hold a response token sampled before
    `policy_version` (by older weights), 0.0 elsewhere."""
    old = ((mb.versions < float(policy_version)) & (mb.loss_mask > 0)).cpu()
    out = torch.zeros(mb.input_ids.shape, dtype=torch.float32)
    for _, row, start, end in mb.spans:
        if bool(old[row, start:end].any()):
            out[row, start:end] = 1.0
    return out


def segments(mb: Microbatch) -> torch.Tensor:
    """Per position, the index of its sequence within the microbatch; -1 on padding."""
    seg = torch.full(mb.input_ids.shape, -1, dtype=torch.int64, device=mb.input_ids.device)
    for j, (_, row, start, end) in enumerate(mb.spans):
        seg[row, start:end] = j
    return seg


@dataclass(frozen=True)
class StepTotals:
    """The whole step's size across data-parallel ranks, and what the loss divides by."""

    tokens: int
    """Response tokens (loss-mask positions) of the step."""
    sequences: int
    denominator: int
    """`tokens` or `sequences`, as the loss's `normaliser` says."""


def step_totals(rm: RankModel, mbs: list[Microbatch], num_seqs: int, loss_fn: TokenLoss,
                global_num_tokens: int | None, global_num_sequences: int | None) -> StepTotals:
    """The step's totals: those given, the rest all-reduced over the data-parallel group from this rank's."""
    from megatron.core import parallel_state as ps

    if global_num_tokens is None or global_num_sequences is None:
        local = torch.tensor([sum(float(mb.loss_mask.sum()) for mb in mbs), float(num_seqs)],
                             dtype=torch.float64, device=rm.device)
        torch.distributed.all_reduce(local, group=ps.get_data_parallel_group())
        global_num_tokens = int(local[0].item()) if global_num_tokens is None else global_num_tokens
        global_num_sequences = int(local[1].item()) if global_num_sequences is None else global_num_sequences
    if global_num_tokens <= 0:
        raise ValueError("forward_backward got no response tokens to train on (every loss mask is empty)")
    normaliser = getattr(loss_fn, "normaliser", "tokens")
    return StepTotals(tokens=global_num_tokens, sequences=global_num_sequences,
                      denominator=global_num_tokens if normaliser == "tokens" else global_num_sequences)


def microbatch_loss(loss_fn: TokenLoss, mbs: list[Microbatch], *, scale: float, policy_version: int, have_old: bool,
                    ref: list[torch.Tensor] | None, stale: list[torch.Tensor]) -> LossFn:
    """Megatron's loss function for the training pass: the policy loss's numerator times `scale` (so that the
    gradients are of the step's normalised loss), with the sums `STEP_SUMS` and the loss's statistics kept."""
    mb_index = {id(mb): i for i, mb in enumerate(mbs)}
    stat_keys = tuple(loss_fn.stat_keys)

    def loss(mb: Microbatch, output: torch.Tensor) -> Any:
        logp = -output.float()
        old = mb.old_logprobs if have_old else logp.detach()
        staleness = (float(policy_version) - mb.versions) * mb.loss_mask
        kwargs: dict[str, Any] = {"segments": segments(mb)}
        if ref is not None:
            kwargs["ref_logprobs"] = ref[mb_index[id(mb)]].to(logp.device)
        pg_sum, stats = loss_fn(logp, old, mb.advantages, mb.loss_mask, staleness, **kwargs)
        k3_pos = torch.zeros_like(logp, dtype=torch.float64)
        if have_old:
            k3_pos = k3(logp.detach(), mb.old_logprobs, mb.loss_mask)
        stale_mask = stale[mb_index[id(mb)]].to(logp.device) * mb.loss_mask
        nll = -(logp.detach().double() * mb.loss_mask).sum()
        return pg_sum * scale, {"pg_sum": pg_sum.detach(), "k3_sum": k3_pos.sum(), "nll_sum": nll,
                                "k3_stale_sum": (k3_pos * stale_mask).sum(), "stale_tokens": stale_mask.sum(),
                                **{k: stats[k].detach() for k in stat_keys}}

    return loss


def summed_over_ranks(rm: RankModel, store: list[dict[str, Any]], mbs: list[Microbatch], stale: list[torch.Tensor],
                      keys: tuple[str, ...], have_traces: bool) -> list[float]:
    """Collective: the microbatch records' `keys`, then the router calls, replayed calls and the router
    disagreement counts (`router_disagreement`'s four), summed over every rank (each counted once per TP group)."""
    local = torch.zeros(len(keys) + 6, dtype=torch.float64, device=rm.device)
    if rm.is_last_stage and rm.rank["tp"] == 0:
        for rec in store:
            local[: len(keys)] += torch.tensor([float(rec[k]) for k in keys], dtype=torch.float64, device=rm.device)
    if rm.replayer is not None:
        if rm.rank["tp"] == 0:
            local[len(keys) : len(keys) + 2] += torch.tensor(
                [rm.replayer.calls, rm.replayer.replayed_calls], dtype=torch.float64, device=rm.device)
        if have_traces:
            local[len(keys) + 2 :] += torch.tensor(router_disagreement(rm, mbs, stale), dtype=torch.float64,
                                                   device=rm.device)
    torch.distributed.all_reduce(local)
    return local.tolist()


def step_metrics(values: list[float], keys: tuple[str, ...], stat_keys: tuple[str, ...], totals: StepTotals,
                 have_old: bool) -> dict[str, float]:
    """The step's metrics from `summed_over_ranks`'s values (see `MegatronLearner.forward_backward`)."""
    sums = dict(zip(keys, values))
    calls, replayed, differ, decisions, differ_stale, decisions_stale = values[len(keys) :]
    nan = float("nan")
    metrics = {
        "loss": sums["pg_sum"] / totals.denominator,
        "tokens": float(totals.tokens),
        "sequences": float(totals.sequences),
        "nll": sums["nll_sum"] / totals.tokens,
        "replay/applied": replayed / calls if calls else 0.0,
        **{k: sums[k] / totals.tokens for k in stat_keys},
    }
    if decisions:
        metrics["train/router_disagreement"] = differ / decisions
        metrics["offpolicy/router_disagreement"] = differ_stale / decisions_stale if decisions_stale else nan
    if have_old:
        metrics["train/rollout_kl"] = sums["k3_sum"] / totals.tokens
        stale_tokens = sums["stale_tokens"]
        metrics["offpolicy/kl"] = sums["k3_stale_sum"] / stale_tokens if stale_tokens else nan
        metrics["offpolicy/stale_fraction"] = stale_tokens / totals.tokens
    return metrics


def forward_backward(rm: RankModel, seqs: Sequence[LearnerSequence], *, mode: str, loss_fn: TokenLoss,
                     policy_version: int, global_num_tokens: int | None, global_num_sequences: int | None,
                     r2_targets: list[torch.Tensor] | None,
                     reference: list[torch.Tensor] | None) -> dict[str, float]:
    """Collective: accumulate the gradients of `loss_fn` on this rank's `seqs` routed as `mode` says
    (`replay_mode`); returns the step's metrics, `loss` NaN/inf when the loss was (the caller drops the
    gradients). `reference`: the KL reference weights, needed when the loss has `kl_coef > 0`."""
    from megatron.core import parallel_state as ps

    rm.model.train()
    have_traces = all(s.routing is not None for s in seqs)
    mbs = microbatches(rm, seqs, mode == "r3", routing=have_traces)
    totals = step_totals(rm, mbs, len(seqs), loss_fn, global_num_tokens, global_num_sequences)
    have_old = all(s.old_logprobs is not None for s in seqs)
    # r2: the routing recorded now, or earlier by `train_batch` (before the batch's first update)
    targets = (r2_targets if r2_targets is not None else record_own_routing(rm, mbs)) if mode == "r2" else None
    ref = None
    if getattr(loss_fn, "kl_coef", 0.0) > 0:
        if reference is None:
            raise ValueError("the loss has a KL penalty (kl_coef > 0) but no reference policy was set; "
                             "call set_reference() once (after the warm start)")
        ref = reference_logprobs(rm, reference, mbs, replay=mode == "r3", targets=targets)
    rm.model.train()
    stale = [stale_positions(mb, policy_version) for mb in mbs]
    loss = microbatch_loss(loss_fn, mbs, scale=len(mbs) * ps.get_data_parallel_world_size() / totals.denominator,
                           policy_version=policy_version, have_old=have_old, ref=ref, stale=stale)
    store = run_schedule(rm, mbs, replay=mode == "r3", targets=targets, forward_only=False, loss_fn=loss,
                         record_free=have_traces)
    stat_keys = tuple(loss_fn.stat_keys)
    keys = STEP_SUMS + stat_keys
    return step_metrics(summed_over_ranks(rm, store, mbs, stale, keys, have_traces), keys, stat_keys, totals, have_old)



def grads_finite(model: Any) -> bool:
    """Whether every gradient this rank accumulated in `model`'s (Megatron DDP's) buffers, dense and expert, is
    finite."""
    for buffer in list(model.buffers) + list(model.expert_parallel_buffers):
        if not bool(torch.isfinite(buffer.grad_data).all()):
            return False
    return True
