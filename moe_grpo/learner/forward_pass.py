"""One pass of Megatron's schedule over a rank's microbatches: batching the sequences, routing each forward
(the rollout's trace replayed, given ids forced, or free), and bringing the last stage's results to every stage.

`RankModel` is what every pass reads: this rank's part of the model and where it sits in the layout. The
learner builds it once; the loss step, the reference and probe forwards and the routing records all run here.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from moe_grpo.learner.batch import LearnerSequence, Microbatch, make_microbatches
from moe_grpo.learner.config import LearnerConfig
from moe_grpo.learner.parallel import ParallelLayout
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.routing.replay import RoutingReplayer, megatron_token_order
from moe_grpo.routing.trace import RoutingTraceError

LossFn = Callable[[Microbatch, torch.Tensor], Any]
"""Megatron's loss function of one microbatch: (microbatch, output) -> (loss, {name: value} kept per microbatch);
`output` is the per-position negative log-prob of the next token on the last stage."""


@dataclass(frozen=True)
class RankModel:
    """This rank's part of the model and where it sits in the layout: what every forward pass reads."""

    model: Any
    """Megatron's DDP wrapper around this stage's GPTModel."""
    replayer: RoutingReplayer | None
    """The routers' replay hooks (None when the learner was built with routing_replay=False)."""
    spec: MoEModelSpec
    config: LearnerConfig
    layout: ParallelLayout
    rank: dict[str, int]
    """This process's ranks (`parallel.ranks()`: tp, pp, ep, dp and their sizes)."""
    is_last_stage: bool
    device: torch.device

    @property
    def module(self) -> Any:
        """The bare GPTModel (this stage's layers)."""
        return self.model.module

    @property
    def sp_size(self) -> int:
        """Ranks a sequence's positions are split over (sequence parallel: the TP ranks), else 1."""
        return self.layout.tensor_parallel if self.layout.sequence_parallel else 1


def microbatches(rm: RankModel, seqs: Sequence[LearnerSequence], replay: bool,
                 routing: bool | None = None) -> list[Microbatch]:
    """`seqs` packed into microbatches on this rank's device; with `replay` each trace is checked against the
    model first and carried along (`routing`: carry the traces without replaying them, for the metrics)."""
    n = len(seqs)
    if n == 0:
        raise ValueError("no sequences given; every data-parallel rank needs at least one")
    if replay:
        for i, s in enumerate(seqs):
            if s.routing is None:
                continue  # make_microbatches names every sequence without a trace
            try:
                s.routing.validate(num_positions=s.num_positions, num_moe_layers=rm.spec.num_moe_layers,
                                   top_k=rm.spec.top_k, num_experts=rm.spec.num_experts)
            except RoutingTraceError as e:
                raise RoutingTraceError(f"sequence {i}: {e}") from e
    batches = make_microbatches(
        seqs,
        list(range(n)),
        micro_batch_size=min(rm.config.micro_batch_size, n),
        pad_multiple=rm.layout.tensor_parallel,
        packed=rm.config.packed,
        with_routing=replay if routing is None else (replay or routing),
        moe_layers=rm.spec.num_moe_layers,
        top_k=rm.spec.top_k,
        seq_len=rm.config.packed_seq_len,
        # Pipeline schedules send one activation shape between stages; Megatron's allgather token dispatcher (TP x EP
        # on gloo) gathers equal token counts over its group. Otherwise each microbatch is padded to its own longest.
        same_shape=rm.layout.pipeline_parallel > 1 or (
            rm.layout.expert_parallel > 1
            and getattr(rm.module.config, "moe_token_dispatcher_type", "alltoall") == "allgather"),
    )
    return [mb.to(rm.device) for mb in batches]


def run_schedule(rm: RankModel, mbs: list[Microbatch], *, replay: bool, forward_only: bool, loss_fn: LossFn,
                 record_free: bool = False, record_used: bool = False,
                 targets: list[torch.Tensor] | None = None) -> list[dict[str, Any]]:
    """One pass of Megatron's schedule over `mbs`; returns each microbatch's loss record on the last stage
    ([] on the others).

    `replay`: force each microbatch's rollout trace (`mb.routing`); `targets`: force these ids instead,
    one `[tokens, moe_layers, topk]` tensor per microbatch in Megatron order (r2: the learner's recorded
    routing). Either way every router call must have used them (`ReplayNotAppliedError` otherwise)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if (replay or targets is not None) and rm.replayer is None:
        raise ValueError("replay requested but the learner was built with routing_replay=False")
    rep = rm.replayer
    if rep is not None:
        rep.clear()
        rep.record_free, rep.record_used = record_free, record_used
    index = {id(mb): i for i, mb in enumerate(mbs)}

    def forward_step(data_iterator: Any, model: Any) -> Any:
        mb: Microbatch = next(data_iterator)
        if rep is not None:
            if targets is not None:
                rep.set_targets(targets[index[id(mb)]])
            elif replay:
                rep.set_targets(megatron_token_order(mb.routing, sp_rank=rm.rank["tp"], sp_size=rm.sp_size))
            else:
                rep.free_running()
        rows, width = mb.input_ids.shape
        position_ids = torch.arange(width, device=mb.input_ids.device).unsqueeze(0).expand(rows, -1)
        out = model(mb.input_ids, position_ids, attention_mask=mb.attention_mask, labels=mb.labels)
        return out, partial(loss_fn, mb)

    rows, width = mbs[0].input_ids.shape
    store = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[rm.model],
        num_microbatches=len(mbs),
        seq_length=width,
        micro_batch_size=rows,
        forward_only=forward_only,
    )
    if rep is not None and (replay or targets is not None):
        rep.require_applied()
    return store if rm.is_last_stage else []


def score_only(mb: Microbatch, output: torch.Tensor) -> Any:
    """A loss function that keeps nothing: for forwards run for their routing records."""
    return output.sum() * 0.0, {}


def keep_logprobs(mb: Microbatch, output: torch.Tensor) -> Any:
    """A loss function that keeps every position's log-prob (on the CPU) under "logprobs"."""
    return output.sum() * 0.0, {"logprobs": (-output.float()).detach().cpu()}


def from_last_stage(rm: RankModel, obj: Any) -> Any:
    """Collective over the pipeline group: the last stage's `obj` on every stage."""
    from megatron.core import parallel_state as ps

    if rm.layout.pipeline_parallel == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                            group=ps.get_pipeline_model_parallel_group())
    return box[0]


def unpack(store: list[dict[str, Any]], mbs: list[Microbatch], key: str, n: int) -> list[np.ndarray]:
    """Per sequence (in the order given to `microbatches`), its positions of `store[...][key]`."""
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * n
    for mb, rec in zip(mbs, store):
        values = rec[key]
        for idx, row, start, end in mb.spans:
            out[idx] = values[row, start:end].numpy().astype(np.float32)
    return out


@contextmanager
def weights_swapped(rm: RankModel, weights: list[torch.Tensor]) -> Iterator[None]:
    """Inside: the model in eval mode with `weights` (one tensor per parameter, in `parameters()` order) in place
    of its own; after (also on an error): its own weights and training mode back. No second model is built, so
    every layout and the routing replay work unchanged."""
    params = list(rm.module.parameters())
    live = [p.data for p in params]
    was_training = rm.model.training
    rm.model.eval()
    try:
        for p, w in zip(params, weights):
            p.data = w
        yield
    finally:
        for p, data in zip(params, live):
            p.data = data
        rm.model.train(was_training)
