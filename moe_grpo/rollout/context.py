"""The engine's context length (vLLM's `max_model_len`): from `rollout.max_model_len`, or the prompts and `max_tokens`.

One function decides it, so the engines, the prompt checks and the evaluation command agree on what fits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the rollout section is the orchestrator's config: a layer above (pyproject.toml)
    from moe_grpo.orchestrator.config import RolloutConfig


def context_length(rollout: RolloutConfig, model_limit: int, longest_prompt: int | None = None, where: str = "", *,
                   dataset: bool = False) -> int:
    """The context an engine is started with, in tokens.

    `rollout.max_model_len` > 0 is taken as given; 0 (auto) is `longest_prompt + rollout.max_tokens`, or
    `model_limit` when the prompts are not known. Refused (ValueError naming the numbers) when it exceeds
    `model_limit` (the model's `max_position_embeddings`) or when the longest prompt plus `rollout.max_tokens`
    does not fit in it: completions would be cut short of `max_tokens` without anyone noticing.
    `where`: which prompt is the longest (a dataset's `file:line`), for the message; `dataset`: the prompts are a
    dataset's rows (the message then offers `data.max_prompt_tokens`, which skips the long ones)."""
    if model_limit < 1:
        raise ValueError(f"the model's max_position_embeddings is {model_limit}, expected >= 1")
    if rollout.max_model_len > model_limit:
        raise ValueError(f"rollout.max_model_len={rollout.max_model_len} exceeds the model's context "
                         f"(max_position_embeddings={model_limit}): expected at most {model_limit}, or 0 (the longest "
                         "prompt plus rollout.max_tokens)")
    if longest_prompt is None:
        return rollout.max_model_len or model_limit
    need = longest_prompt + rollout.max_tokens
    limit = rollout.max_model_len or model_limit
    if need > limit:
        source = (f"rollout.max_model_len={rollout.max_model_len}" if rollout.max_model_len
                  else f"the model's context (max_position_embeddings={model_limit})")
        room, fixes = limit - rollout.max_tokens, []
        if dataset and room > 0:
            fixes.append(f"skip longer prompts as bad rows with data.max_prompt_tokens={room}")
        if longest_prompt < limit:
            fixes.append(f"lower rollout.max_tokens to {limit - longest_prompt}")
        if rollout.max_model_len and need <= model_limit:
            fixes.append(f"raise rollout.max_model_len to {need}")
        fixes = fixes or ["shorten the prompts"]
        raise ValueError(f"the longest prompt ({longest_prompt} tokens{', ' + where if where else ''}) plus "
                         f"rollout.max_tokens={rollout.max_tokens} needs {need} tokens, more than {source}; "
                         + ", or ".join(fixes))
    return rollout.max_model_len or need
