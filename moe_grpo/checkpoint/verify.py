"""Compare next-token log-probs of an HF checkpoint (transformers) and a Megatron checkpoint at a layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moe_grpo.learner.parallel import ParallelLayout, gather_by_index
from moe_grpo.learner.spawn import run_distributed
from moe_grpo.models.options import gloo_dispatcher_problem
from moe_grpo.models.spec import read_spec


def sample_sequences(vocab_size: int, n: int = 4, length: int = 24, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=length) for _ in range(n)]


def hf_logprobs(hf_dir: str | Path, seqs: list[np.ndarray]) -> list[np.ndarray]:
    """Log-prob of each next token under the HF model, computed by transformers in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.as_tensor(s, dtype=torch.long).unsqueeze(0)
            logits = model(ids).logits.float()
            lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
            out.append(lp.numpy())
    return out


def default_dispatcher(tp: int, ep: int) -> str:
    """Megatron's token dispatcher for a layout: alltoall, except where a learner on CPU cannot run it
    (`models.options.gloo_dispatcher_problem`: TP x EP), so allgather, which gives the same results."""
    import torch

    on_gloo = not torch.cuda.is_available()
    return "allgather" if on_gloo and gloo_dispatcher_problem(tp, ep, "alltoall") else "alltoall"


def megatron_logprobs(megatron_dir: str, tp: int, ep: int, pp: int, seqs: list[np.ndarray],
                      token_dispatcher: str | None = None) -> Any:
    """Runs in every rank of a (tp, ep, pp) group: load the checkpoint, return log-probs on rank 0."""
    from moe_grpo.checkpoint.convert import _checkpoint_dtype
    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.models.megatron import MegatronOptions

    spec = read_spec(megatron_dir)
    learner = MegatronLearner(spec, ParallelLayout(tp, ep, pp), LearnerConfig(micro_batch_size=len(seqs)),
                              MegatronOptions(params_dtype=_checkpoint_dtype(megatron_dir),
                                              token_dispatcher=token_dispatcher or default_dispatcher(tp, ep)))
    learner.load_checkpoint(megatron_dir)
    dp, dp_size = learner.rank["dp"], learner.rank["dp_size"]
    mine = list(range(dp, len(seqs), dp_size))
    lps = learner.logprobs([LearnerSequence(seqs[i], prompt_len=1) for i in mine], replay=False)
    merged = gather_by_index(mine, lps)
    return [merged[i] for i in range(len(seqs))]


def verify(hf_dir: str | Path, megatron_dir: str | Path, *, tp: int = 1, ep: int = 1, pp: int = 1,
           n: int = 4, length: int = 24, token_dispatcher: str | None = None) -> dict[str, Any]:
    """Max / mean absolute difference of per-token log-probs between the two checkpoints.

    `token_dispatcher`: Megatron's MoE token dispatcher for the layout; None = `default_dispatcher(tp, ep)`."""
    spec = read_spec(megatron_dir)
    seqs = sample_sequences(spec.vocab_size, n=n, length=length)
    ref = hf_logprobs(hf_dir, seqs)
    world = tp * pp * ep
    dispatcher = token_dispatcher or default_dispatcher(tp, ep)
    got = run_distributed(megatron_logprobs, world, str(megatron_dir), tp, ep, pp, seqs, dispatcher)[0]
    diffs = np.concatenate([np.abs(a - b) for a, b in zip(ref, got)])
    return {"max_abs_logprob_diff": float(diffs.max()), "mean_abs_logprob_diff": float(diffs.mean()),
            "tokens": float(diffs.size), "tp": tp, "ep": ep, "pp": pp, "token_dispatcher": dispatcher}
