"""Score a policy on a held-out set: one greedy completion and `samples` sampled ones per prompt, on one vLLM engine.

Every step is the training run's own code: the policy's model description and tokenizer (as `init.hf` reads them),
the held-out set (orchestrator/run_prompts.py), the engine's context (rollout/context.py), the engine
(rollout/vllm_engine.py), greedy sampling (orchestrator/groups.py) and the reward functions and their scoring
(reward/). So the greedy reward mean of a run's `policy/` is the run's last `eval/reward/mean`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import as_completed
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from moe_grpo.checkpoint.hf_init import InitConfig
from moe_grpo.data.tokenizer import policy_tokenizer
from moe_grpo.evaluation.config import EvaluateConfig
from moe_grpo.evaluation.pass_at_k import pass_at_k
from moe_grpo.evaluation.run_settings import differences_from_the_run
from moe_grpo.orchestrator.groups import sampling_settings
from moe_grpo.orchestrator.logs import quiet_vllm
from moe_grpo.orchestrator.run_prompts import held_out_source
from moe_grpo.orchestrator.session import check_reward_paths
from moe_grpo.reward.functions import Rewards
from moe_grpo.reward.scoring import held_out_rewards, score_group
from moe_grpo.rollout import engine_core_start
from moe_grpo.rollout.context import context_length
from moe_grpo.rollout.types import SamplingSettings
from moe_grpo.validate import refused_inputs

log = logging.getLogger("moe_grpo")

SUMMARY = "evaluation.json"
ROWS = "evaluation_rows.jsonl"


def evaluate(cfg: EvaluateConfig, out_dir: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Score `cfg.policy`; writes `SUMMARY` and `ROWS` (and vLLM's log, `engine.log`) under `out_dir` and returns
    the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    quiet_vllm(out)  # before vLLM is imported: its log goes to out_dir/engine.log, the console keeps the bar
    t0 = time.perf_counter()
    spec = InitConfig(hf=cfg.policy).model_spec()
    with refused_inputs():  # a missing or unusable file, a prompt too long, a reward that does not import
        tokenizer = policy_tokenizer(spec, cfg.policy)
        source = held_out_source(cfg, tokenizer)
        examples = source.held_out  # never empty: held_out_source refuses a file with no usable row
        context = context_length(cfg.rollout, spec.max_position_embeddings, *source.longest_prompt(),
                                 dataset=bool(cfg.data.eval_path))
        check_reward_paths(cfg)
        differs = differences_from_the_run(dataclasses.asdict(cfg), cfg.policy)
        if differs:
            log.warning("the run that exported %s trained with other settings than this evaluation's (%s): its "
                        "scores are not the run's held-out ones; repeat the run's keys to score as it did",
                        cfg.policy, "; ".join(differs))
        rewards = Rewards(*cfg.reward.resolved(cfg.task.name), timeout_s=cfg.reward.timeout_s)
    greedy = sampling_settings(cfg, tokenizer, greedy=True)
    r = cfg.rollout
    engine = None
    try:
        # The engine core's process server imports vLLM's engine core beside this process's own import of vLLM (two
        # ~11 s imports on two cores), not after it, when the engine starts (rollout/engine_core_start.py).
        engine_core_start.start_server_on_cpu()
        from moe_grpo.rollout.vllm_engine import VllmEngine

        # No routing capture: evaluation trains nothing, and the hooks only record what the routers chose.
        engine = VllmEngine(cfg.policy, spec, max_model_len=context, max_num_seqs=r.max_num_seqs,
                            kv_cache_gib=r.kv_cache_gib, dtype=r.dtype, seed=cfg.seed, capture=False,
                            request_timeout_s=r.request_timeout_s, name="evaluate")
        requests = {}
        for i, e in enumerate(examples):
            requests[engine.submit(e.prompt_ids, greedy)] = (i, "greedy")
            if cfg.samples:
                sampled = SamplingSettings(n=cfg.samples, temperature=r.temperature, top_p=r.top_p,
                                           max_tokens=r.max_tokens, stop_token_ids=tuple(tokenizer.stop_ids),
                                           seed=cfg.seed + i * cfg.samples)
                requests[engine.submit(e.prompt_ids, sampled)] = (i, "samples")
        done: dict[tuple[int, str], Any] = {}
        with tqdm(total=len(requests), desc="evaluate", unit="request", disable=not progress) as bar:
            for future in as_completed(requests, timeout=r.request_timeout_s * max(1, len(requests))):
                done[requests[future]] = future.result()
                bar.update()
        rows, summary = _score(cfg, tokenizer, rewards, examples, done)
    finally:
        if engine is not None:
            engine.shutdown()
        rewards.close()
    with open(out / ROWS, "w") as f:
        # default=str: a Parquet row's prompt may carry values JSON has no type for (a message's timestamp)
        f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
    summary.update(policy=str(Path(cfg.policy).resolve()), task=cfg.task.name,
                   reward=cfg.reward.describe(cfg.task.name), differs_from_run=differs,
                   bad_rows=source.bad_rows, max_model_len=context,
                   seconds=round(time.perf_counter() - t0, 1), rows_file=str((out / ROWS).resolve()),
                   dataset=cfg.data.eval_path or f"task {cfg.task.name}: held-out set (task.eval_seed="
                                                  f"{cfg.task.eval_seed}, task.eval_size={cfg.task.eval_size})")
    (out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _score(cfg: EvaluateConfig, tokenizer: Any, rewards: Any, examples: list[Any],
           done: dict[tuple[int, str], Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-row results and the summary from the completions; a reward that failed counts as 0 (as in the run)."""
    greedy_ids = [done[(i, "greedy")][0].token_ids for i in range(len(examples))]
    greedy = held_out_rewards(rewards, tokenizer, examples, greedy_ids)
    rows, correct, failed = [], [], 0
    for i, e in enumerate(examples):
        row = {"index": i, "where": e.where, "prompt": e.prompt, "answer": e.answer,
               "greedy": tokenizer.completion_text(greedy_ids[i]), "greedy_reward": float(greedy[i]),
               "greedy_correct": bool(greedy[i] >= cfg.correct_at)}
        if cfg.samples:
            completions = done[(i, "samples")]
            kept, scores, n_failed = score_group(rewards, tokenizer, e, completions)
            failed += n_failed
            sample_rewards = [None] * len(completions)
            for j, s in zip(kept, scores):
                sample_rewards[j] = float(s)
            c = int(sum(s >= cfg.correct_at for s in scores))
            correct.append(c)
            row.update(samples=[tokenizer.completion_text(x.token_ids) for x in completions],
                       sample_rewards=sample_rewards, correct=c,
                       **{f"pass@{k}": pass_at_k(cfg.samples, c, k) for k in cfg.pass_k})
        rows.append(row)
    summary: dict[str, Any] = {
        "rows": len(examples),
        "greedy": {"reward_mean": float(np.mean(greedy)), "accuracy": float(np.mean(greedy >= cfg.correct_at))},
        "correct_at": cfg.correct_at, "max_tokens": cfg.rollout.max_tokens, "samples": cfg.samples}
    if cfg.samples:
        summary.update(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, sample_reward_failed=failed,
                       **{f"pass@{k}": float(np.mean([pass_at_k(cfg.samples, c, k) for c in correct]))
                          for k in cfg.pass_k})
    return rows, summary
