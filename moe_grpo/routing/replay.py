"""Rollout routing replay (R3) through megatron-core's own `RouterReplay`.

megatron-core 0.16.1 builds one `RouterReplay` per MoE router when
`moe_enable_routing_replay=True`: REPLAY_FORWARD forces the given top-k ids
and gathers their probabilities from the live scores (so the router still
gets gradients); REPLAY_BACKWARD pops ids from a FIFO for activation
recompute. This module

- finds this pipeline stage's routers through the model (not through
  RouterReplay's process-global list, which outlives models), and maps each to
  its MoE-layer index in the routing trace (dense layers are not in traces);
- hands each router the ids of this rank's own tokens, in Megatron's token
  order ([sequence, batch] flattened; with sequence parallel, this TP rank's
  slice of the sequence);
- switches to REPLAY_BACKWARD while autograd runs a recompute, so any
  schedule (1F1B included) replays the same ids in forward and recompute;
- counts every router call and whether it used replayed ids, and can record
  the ids a router chose and the ids it would have chosen free-running;
- refuses configurations in which megatron-core silently ignores replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


class ReplayNotAppliedError(RuntimeError):
    """Replay was requested but some MoE layer calls routed freely."""


def check_replay_supported(config: Any) -> None:
    """Refuse Megatron configs in which RouterReplay would be silently bypassed."""
    problems = []
    if not getattr(config, "moe_enable_routing_replay", False):
        problems.append("moe_enable_routing_replay=False (no RouterReplay hooks are built)")
    if getattr(config, "moe_router_fusion", False):
        problems.append("moe_router_fusion=True (the fused router returns before replay and ignores it)")
    if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        problems.append("moe_router_load_balancing_type='sinkhorn' (sinkhorn routing never consults replay)")
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        problems.append("moe_expert_capacity_factor is set (token dropping would override replayed routing)")
    if problems:
        raise ValueError("routing replay cannot be applied with this Megatron config: " + "; ".join(problems))


@dataclass
class _RouterSlot:
    moe_index: int
    """Index of this router's layer among the model's MoE layers (the trace's layer axis)."""
    replay: Any
    """megatron.core.transformer.moe.router_replay.RouterReplay instance."""
    calls: int = 0
    replayed_calls: int = 0
    used: list[torch.Tensor] = field(default_factory=list)
    free: list[torch.Tensor] = field(default_factory=list)


def _in_autograd_backward() -> bool:
    # -1 outside a backward pass; activation recompute runs inside one.
    return torch._C._current_graph_task_id() != -1


class RoutingReplayer:
    """Drives every RouterReplay of one model chunk (one pipeline stage)."""

    def __init__(self, model: Any, moe_layer_pattern: list[int], *, recompute: bool = False) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._actions = RouterReplayAction
        self.recompute = recompute
        self.slots: list[_RouterSlot] = []
        moe_index_of_layer = [sum(moe_layer_pattern[:i]) for i in range(len(moe_layer_pattern))]
        for layer in _decoder_layers(model):
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is None:
                continue  # dense layer: not in the trace
            if router.router_replay is None:
                check_replay_supported(router.config)
            if not moe_layer_pattern[layer.layer_number - 1]:
                raise RuntimeError(f"layer {layer.layer_number} has a router but the model spec says it is dense")
            slot = _RouterSlot(moe_index_of_layer[layer.layer_number - 1], router.router_replay)
            self._wrap(slot)
            self.slots.append(slot)
        self.record_used = False
        self.record_free = False
        self.replaying = False

    # ---- per-call instrumentation ----------------------------------------------------
    def _wrap(self, slot: _RouterSlot) -> None:
        replay = slot.replay
        original: Callable[..., Any] = type(replay).get_replay_topk.__get__(replay)
        actions = self._actions

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):  # type: ignore[no-untyped-def]
            slot.calls += 1
            # Free choices are recorded once per forward (not again during activation recompute).
            record_free = self.record_free and not _in_autograd_backward()
            if record_free and replay.router_replay_action in (actions.REPLAY_FORWARD, actions.REPLAY_BACKWARD):
                with torch.no_grad():
                    slot.free.append(default_compute_topk(scores.detach(), topk, num_groups, group_topk)[1].cpu())
            if replay.router_replay_action == actions.REPLAY_FORWARD and _in_autograd_backward():
                replay.router_replay_action = actions.REPLAY_BACKWARD
                try:
                    probs, idx = original(scores, topk, num_groups, group_topk, default_compute_topk)
                finally:
                    replay.router_replay_action = actions.REPLAY_FORWARD
            else:
                probs, idx = original(scores, topk, num_groups, group_topk, default_compute_topk)
            if replay.router_replay_action in (actions.REPLAY_FORWARD, actions.REPLAY_BACKWARD):
                slot.replayed_calls += 1
            if record_free and replay.router_replay_action is None:
                slot.free.append(idx.detach().cpu())
            if self.record_used:
                slot.used.append(idx.detach().cpu())
            return probs, idx

        replay.get_replay_topk = get_replay_topk

    # ---- control ---------------------------------------------------------------------
    @property
    def moe_indices(self) -> list[int]:
        """The trace layer indices this stage owns, in order."""
        return [s.moe_index for s in self.slots]

    def set_targets(self, local_ids: torch.Tensor) -> None:
        """Force routing for the next forward of this stage.

        `local_ids`: `[tokens, moe_layers_total, topk]` for this rank's tokens in
        Megatron order; this stage picks its own layers.
        """
        if local_ids.dim() != 3:
            raise ValueError(f"replay ids have shape {tuple(local_ids.shape)}, expected [tokens, moe_layers, topk]")
        ids = local_ids.to(torch.int64)
        for slot in self.slots:
            if not self.recompute:
                slot.replay.clear_indices()  # the backward FIFO is only popped under recompute
            slot.replay.set_target_indices(ids[:, slot.moe_index, :].contiguous())
            slot.replay.set_router_replay_action(self._actions.REPLAY_FORWARD)
        self.replaying = True

    def free_running(self) -> None:
        """Let the routers choose (no replay) from the next forward on."""
        for slot in self.slots:
            slot.replay.clear_indices()
            slot.replay.clear_router_replay_action()
        self.replaying = False

    def reset_counters(self) -> None:
        for slot in self.slots:
            slot.calls = slot.replayed_calls = 0
            slot.used.clear()
            slot.free.clear()

    def clear(self) -> None:
        """Drop all ids and return to free-running; call at every step boundary."""
        self.free_running()
        self.reset_counters()

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.slots)

    @property
    def replayed_calls(self) -> int:
        return sum(s.replayed_calls for s in self.slots)

    def applied_fraction(self) -> float:
        """Fraction of MoE layer calls on this stage that used replayed ids (1.0 when none ran)."""
        return self.replayed_calls / self.calls if self.calls else 1.0

    def require_applied(self) -> None:
        """Fail loudly when replay was requested but some router call routed freely."""
        if self.calls == 0 and self.slots:
            raise ReplayNotAppliedError("routing replay was requested but no MoE router ran on this stage")
        missing = [s.moe_index for s in self.slots if s.replayed_calls < s.calls]
        if missing:
            raise ReplayNotAppliedError(
                f"routing replay was requested but MoE layers {missing} routed freely on "
                f"{self.calls - self.replayed_calls} of {self.calls} calls"
            )


def _decoder_layers(model: Any) -> Iterable[Any]:
    module = model
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module  # unwrap DDP / Float16Module
    decoder = getattr(module, "decoder", None)
    if decoder is None:
        raise TypeError(f"{type(model).__name__} has no decoder; expected a Megatron GPTModel")
    return list(decoder.layers)


def megatron_token_order(batch_ids: torch.Tensor, *, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """`[batch, seq, L, k]` -> this SP rank's `[seq/sp * batch, L, k]` in Megatron's [s, b] order."""
    if batch_ids.dim() != 4:
        raise ValueError(f"batch routing ids have shape {tuple(batch_ids.shape)}, expected [batch, seq, moe_layers, topk]")
    b, s = batch_ids.shape[:2]
    if s % sp_size:
        raise ValueError(f"sequence length {s} is not divisible by the sequence-parallel size {sp_size}")
    chunk = s // sp_size
    local = batch_ids[:, sp_rank * chunk : (sp_rank + 1) * chunk]
    return local.transpose(0, 1).reshape(chunk * b, *batch_ids.shape[2:])


def batch_order_from_megatron(tokens_ids: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of `megatron_token_order` for one SP rank: `[s*b, ...]` -> `[b, s, ...]`."""
    s = tokens_ids.shape[0] // batch
    return tokens_ids.reshape(s, batch, *tokens_ids.shape[1:]).transpose(0, 1)
