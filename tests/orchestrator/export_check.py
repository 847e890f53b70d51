"""Does vLLM serve an exported policy with the learner's log-probs? (used by test_hf_runs.py)

vLLM samples completions from the exported directory; the same tokens are
scored by a Megatron learner loaded (at a chosen layout) from that directory
converted back; the per-token log-probs of the sampled tokens are compared.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def served_vs_learner(policy_dir: str, tp: int, ep: int, prompts: list[str], work_dir: str | Path,
                      n: int = 2, max_tokens: int = 8) -> dict[str, float]:
    from moe_grpo.checkpoint.convert import hf_to_megatron
    from moe_grpo.checkpoint.hf_init import InitConfig
    from moe_grpo.checkpoint.verify import megatron_logprobs
    from moe_grpo.data.tokenizer import HFTokenizer
    from moe_grpo.learner.spawn import run_distributed
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import VllmEngine

    spec = InitConfig(hf=policy_dir).model_spec()
    tok = HFTokenizer(policy_dir, spec.vocab_size)  # the export carries a tokenizer transformers loads
    engine = VllmEngine(policy_dir, spec, max_model_len=256, max_num_seqs=16, seed=0)
    try:
        sampling = SamplingSettings(n=n, temperature=1.0, max_tokens=max_tokens, stop_token_ids=tok.stop_ids)
        groups = engine.generate([tok.encode_prompt(p) for p in prompts], sampling)
    finally:
        engine.shutdown()
    completions = [c for g in groups for c in g]
    assert all(c.ok and len(c.token_ids) for c in completions), [c.error or c.finish_reason for c in completions]
    seqs = [np.concatenate([c.prompt_ids, c.token_ids]) for c in completions]
    mg = Path(work_dir) / "policy_megatron"
    hf_to_megatron(policy_dir, mg, progress=False)
    learner = run_distributed(megatron_logprobs, tp * ep, str(mg), tp, ep, 1, seqs)[0]
    diffs = []
    for c, lp in zip(completions, learner):
        start = len(c.prompt_ids) - 1  # log-prob of token i+1 sits at position i
        diffs.append(np.abs(lp[start : start + len(c.token_ids)] - c.logprobs))
    d = np.concatenate(diffs)
    return {"max_abs_logprob_diff": float(d.max()), "mean_abs_logprob_diff": float(d.mean()), "tokens": float(d.size)}
