"""What goes into and comes out of a vLLM engine's requests (rollout/vllm_engine.py): prompts checked, sampling
parameters, and vLLM's outputs -> `Completion`s with per-token log-probs, versions and routing.

Routing comes from one of two paths with one output format:
- vLLM's native `enable_return_routed_experts` (Model Runner V2; GPU only: V2 needs Triton, which has no CPU
  backend): `native_routing_to_trace`;
- otherwise the worker extension in `worker_extension.py`, which hooks every MoE router (what runs on CPU) and
  hands each request's rows back packed (`unpack_routing`).
Either way each completion carries a `RoutingTrace` of `prompt + generated - 1` rows over the MoE layers only.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.types import Completion, SamplingSettings
from moe_grpo.routing.trace import RoutingTrace


def check_prompt(prompt: Sequence[int], vocab_size: int, max_model_len: int) -> str | None:
    """Why this prompt cannot be served (empty, ids outside the vocabulary, no room in the context), or None."""
    if len(prompt) == 0:
        return "empty prompt: expected at least one token id"
    ids = np.asarray(prompt)
    if ids.dtype.kind not in "iu":
        return f"prompt token ids have dtype {ids.dtype}, expected integers"
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        return f"token id {int(bad[0])} outside the vocabulary, expected 0 <= id < {vocab_size}"
    if len(prompt) >= max_model_len:
        return (f"prompt of {len(prompt)} tokens does not fit the context of {max_model_len} "
                "(it needs room for at least one generated token)")
    return None


def sampling_params(sampling: SamplingSettings, max_tokens: int, k: int, offset: int) -> Any:
    """vLLM's SamplingParams for sample `k` of a prompt, `offset` tokens into it (a resubmitted segment)."""
    from vllm import SamplingParams

    # The caller's stop_token_ids are the only stops (ignore_eos: the checkpoint's own eos is not added).
    # A resubmitted segment (abort on update) gets its own seed, offset by the tokens already sampled.
    seed = None if sampling.seed is None else (sampling.seed + k + 7919 * offset) % (2**63)
    return SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=max_tokens,
                          logprobs=0, stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True, seed=seed)


def native_routing_to_trace(routed: Any, spec: MoEModelSpec, num_positions: int) -> RoutingTrace:
    """vLLM's native `CompletionOutput.routed_experts` -> a trace of MoE layers only.

    vLLM reports `[seq_len, num_layers, topk]`; with DeepSeek's leading dense
    layers the first `first_k_dense` columns carry no routing and are dropped.
    """
    ids = np.asarray(routed)
    if ids.ndim != 3:
        raise EngineError(f"native routed_experts has shape {ids.shape}, expected [seq_len, layers, topk]")
    if ids.shape[1] == spec.num_layers and spec.first_k_dense:
        ids = ids[:, spec.first_k_dense :]
    if ids.shape[1] != spec.num_moe_layers:
        raise EngineError(f"native routed_experts has {ids.shape[1]} layers, expected {spec.num_layers} "
                          f"(all) or {spec.num_moe_layers} (MoE only)")
    if ids.shape[0] < num_positions:
        raise EngineError(f"native routed_experts has {ids.shape[0]} rows, expected {num_positions}")
    return RoutingTrace.from_array(ids[:num_positions], spec.num_experts)


def unpack_routing(packed: dict[str, Any]) -> dict[str, Any]:
    """The worker's `moe_grpo_pop_routing` answer -> {"rows": the request's routing rows} or {"error": why}."""
    out: dict[str, Any] = {}
    for rid, value in packed.items():
        if value[0] == "error":
            out["error"] = value[1]
        else:
            dtype, shape, data = value
            out["rows"] = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    return out


def join_stage_routing(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """The `unpack_routing` forms of one request from each pipeline stage's capturing worker, in stage order -> one
    (`unpack_routing`'s form): rows [positions, MoE layers of every stage in layer order, top-k]. A stage's error
    is the request's; rows from only some stages are an error (a trace missing layers is never handed on). The
    stages' buffers grow alike but are cut to the rows all of them hold."""
    if len(stages) == 1:
        return stages[0]
    errors = [s["error"] for s in stages if "error" in s]
    if errors:
        return {"error": errors[0]}
    rows = [s["rows"] for s in stages if "rows" in s]
    if not rows:
        return {}
    if len(rows) != len(stages):
        return {"error": f"routing captured by {len(rows)} of {len(stages)} pipeline stages"}
    n = min(r.shape[0] for r in rows)
    return {"rows": np.concatenate([r[:n] for r in rows], axis=1)}


def versions_from_spans(spans: Any, num_tokens: int, fallback: int) -> np.ndarray:
    """vLLM's per-completion `weight_versions` spans -> one policy version per generated token."""
    out = np.full(num_tokens, fallback, np.int64)
    for span in spans or ():
        try:
            out[span.start : span.end] = int(span.version)
        except ValueError as e:
            raise EngineError(f"weight version {span.version!r} is not an integer policy version") from e
    return out


def completion_of(final: Any, prompt: list[int], routing: dict[str, Any], *, request_id: str, spec: MoEModelSpec,
                  capture: bool, native: bool, version: int, adapter_version: int | None) -> Completion:
    """vLLM's final output of one request (None: it was aborted) -> its Completion. `routing`: what the worker
    captured (`unpack_routing`); `version`: the version served now; `adapter_version`: with served adapters, the
    version every token is of (the adapter the request started on). A completion whose routing capture failed
    has `finish_reason="error"` and says why."""
    ids = np.asarray(prompt, np.int64)
    if final is None or not final.outputs:
        return Completion(ids, finish_reason="abort")
    c = final.outputs[0]
    tokens = np.asarray(c.token_ids, dtype=np.int64)
    lps = np.asarray([c.logprobs[j][int(t)].logprob for j, t in enumerate(tokens)], dtype=np.float32)
    if adapter_version is not None:  # every token of a served-adapter request is of the adapter it started on
        versions = np.full(len(tokens), adapter_version, dtype=np.int64)
    else:
        versions = versions_from_spans(getattr(c, "weight_versions", None), len(tokens), version)
    finish = str(c.finish_reason or "")
    n_pos = len(ids) + len(tokens) - 1
    trace, error = None, None
    if capture and native and len(tokens):
        trace = native_routing_to_trace(c.routed_experts, spec, n_pos)
    elif capture and len(tokens):
        rows = routing.get("rows")
        if "error" in routing:
            error = f"routing capture failed in the worker: {routing['error']}"
        elif rows is None or rows.shape[0] < n_pos or (rows[:n_pos] < 0).any():
            error = f"routing capture is missing rows for request {request_id} ({n_pos} positions expected)"
        else:
            trace = RoutingTrace.from_array(rows[:n_pos], spec.num_experts)
    return Completion(ids, tokens, lps, trace, versions, "error" if error else finish, error)


def join_segments(first: Completion, second: Completion) -> Completion:
    """One completion from a request aborted by a weight update and its resubmission (prompt + tokens so far).

    Positions the first segment ran through keep its routing rows; the rest
    come from the second segment's forward passes under the new weights.
    """
    n1 = len(first.token_ids)
    if len(second.prompt_ids) != len(first.prompt_ids) + n1:
        raise EngineError(f"resubmitted prompt has {len(second.prompt_ids)} tokens, expected "
                          f"{len(first.prompt_ids)} + {n1}")
    routing = second.routing
    if n1 and first.routing is not None and second.routing is not None:
        keep = first.num_positions
        rows = np.concatenate([first.routing.expert_ids[:keep], second.routing.expert_ids[keep:]])
        routing = RoutingTrace.from_array(rows, first.routing.num_experts)
    return Completion(first.prompt_ids, np.concatenate([first.token_ids, second.token_ids]),
                      np.concatenate([first.logprobs, second.logprobs]), routing,
                      np.concatenate([first.versions, second.versions]), second.finish_reason, second.error,
                      resubmits=first.resubmits + 1)
