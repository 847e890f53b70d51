"""Code that runs inside every vLLM worker (`worker_extension_cls`), vLLM 0.32 V1 runner.

Routing capture: each MoE router's `set_capture_fn` hands us the step's
logical top-k ids `[tokens, topk]` (before EPLB mapping). The model runner's
batch order changes from step to step, so `_prepare_inputs` is wrapped to
record, for the step about to run, which requests are in it, how many tokens
each contributes and from which position (`num_computed_tokens`). After the
step, rows are written into per-request buffers at their positions, so
chunked prefill fills a prompt piece by piece and a preempted-and-recomputed
request overwrites its own rows: every position ends up with exactly one row,
from the forward that produced the sampled tokens. Only MoE layers have
routers, so dense layers never enter the trace.

Prefix caching must be off: cached positions are never recomputed and would
get no rows.

Tensor parallelism: every worker runs every router on the full hidden states (the gate is a `ReplicatedLinear`
after attention's all-reduce; vLLM 0.32 splits tokens across ranks only for sequence-parallel MoE, i.e. expert
parallelism with data parallelism), so every rank computes the same complete top-k. Only tensor-parallel rank 0
captures: one trace per request, never one per worker.

Pipeline parallelism: each stage's workers hold only its run of layers (vLLM puts a `PPMissingLayer`, without a
router, in place of the others), so tensor-parallel rank 0 of every stage captures the MoE layers of that stage
and the engine puts the stages' traces side by side in stage order (`engine_outputs.join_stage_routing`): one
trace per request, in layer order. Every stage runs the same scheduler output each step, so the rows line up.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from functools import partial
from typing import Any

import numpy as np

from moe_grpo.rollout import vllm_patches

# vLLM imports this module in its engine process before it builds the model, and an MoE layer picks its kernel
# while it is built: this is the one point early enough for the MoE-backend patch (a no-op without LoRA or when the
# routed experts are LoRA targets) and the sampler's. On a GPU nothing is patched.
vllm_patches.apply_cpu_patches_before_build()


class RoutingCaptureExtension:
    """Mixed into vLLM's worker class; methods are called through `collective_rpc`."""

    # ---------------------------------------------------------------- setup
    def moe_grpo_install(self, capture: bool = True) -> dict[str, Any]:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        vllm_patches.apply_cpu_patches_after_build(model)
        tp_rank, pp_rank = int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
        capture = bool(capture) and tp_rank == 0  # the other ranks compute the same routing (module docstring)
        layers = []
        for module in model.modules():
            if tp_rank != 0:
                break  # no hooks: this worker never captures
            router = getattr(module, "router", None)
            if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
                router.set_capture_fn(partial(self._mg_on_route, int(module.layer_id)))
                layers.append(int(module.layer_id))
        self._mg_layers = sorted(layers)
        self._mg_column = {layer: i for i, layer in enumerate(self._mg_layers)}
        self._mg_capture = capture
        self._mg_step: dict[str, Any] | None = None
        self._mg_buffers: dict[str, np.ndarray] = {}
        self._mg_errors: dict[str, str] = {}
        self._mg_hook_seconds = 0.0
        if not getattr(runner, "_mg_wrapped", False):
            prepare, execute = runner._prepare_inputs, runner.execute_model

            def _prepare_inputs(scheduler_output: Any, num_scheduled_tokens: Any, *a: Any, **k: Any) -> Any:
                if self._mg_capture:
                    batch = runner.input_batch
                    n = batch.num_reqs
                    self._mg_step = {
                        "req_ids": list(batch.req_ids[:n]),
                        "num_tokens": [int(x) for x in num_scheduled_tokens[:n]],
                        "start": [int(x) for x in batch.num_computed_tokens_cpu[:n]],
                        "total": int(scheduler_output.total_num_scheduled_tokens),
                        "ids": {},
                    }
                return prepare(scheduler_output, num_scheduled_tokens, *a, **k)

            def execute_model(scheduler_output: Any, *a: Any, **k: Any) -> Any:
                try:
                    return execute(scheduler_output, *a, **k)
                finally:
                    self._mg_flush()

            runner._prepare_inputs, runner.execute_model = _prepare_inputs, execute_model
            runner._mg_wrapped = True
        return {"moe_layers": self._mg_layers, "pid": os.getpid(), "tp_rank": tp_rank, "pp_rank": pp_rank,
                "capturing": capture, "host": os.uname().nodename}

    def moe_grpo_set_capture(self, on: bool) -> bool:
        from vllm.distributed import get_tensor_model_parallel_rank

        self._mg_capture = bool(on) and get_tensor_model_parallel_rank() == 0  # rank 0 alone captures
        return self._mg_capture

    # ---------------------------------------------------------------- capture
    def _mg_on_route(self, layer_id: int, topk_ids: Any) -> None:
        step = self._mg_step
        if step is None:
            return  # warm-up / profiling forwards belong to no request
        step["ids"][layer_id] = topk_ids[: step["total"]].to("cpu").numpy().astype(np.int16, copy=True)

    def _mg_flush(self) -> None:
        """File the step's rows under each request. A failure here fails the step's requests, not the engine."""
        step, self._mg_step = self._mg_step, None
        if step is None or not step["ids"]:
            return
        t0 = time.perf_counter()
        try:
            self._mg_store(step)
        except Exception as e:  # noqa: BLE001 - reported on each affected request's completion
            for rid in step["req_ids"]:
                self._mg_errors.setdefault(rid, f"{type(e).__name__}: {e}")
                self._mg_buffers.pop(rid, None)
        self._mg_hook_seconds += time.perf_counter() - t0

    def _mg_store(self, step: dict[str, Any]) -> None:
        if len(step["ids"]) != len(self._mg_layers):
            missing = sorted(set(self._mg_layers) - set(step["ids"]))
            raise RuntimeError(f"routing capture: MoE layers {missing} reported no routing in this step")
        ids = np.stack([step["ids"][layer] for layer in self._mg_layers], axis=1)  # [T, L, k]
        offset = 0
        for rid, n, start in zip(step["req_ids"], step["num_tokens"], step["start"]):
            end = start + n
            if rid in self._mg_errors:
                offset += n
                continue
            buf = self._mg_buffers.get(rid)
            if buf is None or buf.shape[0] < end:
                grown = np.full((max(end, 2 * (0 if buf is None else buf.shape[0])),) + ids.shape[1:], -1, np.int16)
                if buf is not None:
                    grown[: buf.shape[0]] = buf
                buf = grown
                self._mg_buffers[rid] = buf
            buf[start:end] = ids[offset : offset + n]
            offset += n

    def moe_grpo_pop_routing(self, prefixes: list[str]) -> dict[str, tuple]:
        """Routing of the requests whose worker id starts with one of `prefixes`, then forget them.

        Arrays travel as (dtype, shape, bytes): collective_rpc does not carry numpy arrays.
        A request whose capture failed comes back as ("error", message).
        """
        out: dict[str, tuple] = {}
        for rid in list(self._mg_buffers) + list(self._mg_errors):
            if any(rid.startswith(p) for p in prefixes):
                if rid in self._mg_errors:
                    out[rid] = ("error", self._mg_errors.pop(rid))
                    self._mg_buffers.pop(rid, None)
                elif rid in self._mg_buffers:
                    a = self._mg_buffers.pop(rid)
                    out[rid] = (a.dtype.str, list(a.shape), a.tobytes())
        return out

    def moe_grpo_num_routing_buffers(self) -> int:
        """Requests whose routing the worker still holds (in flight, or never popped: a leak)."""
        return len(self._mg_buffers) + len(self._mg_errors)

    def moe_grpo_drop_routing(self) -> int:
        n = len(self._mg_buffers) + len(self._mg_errors)
        self._mg_buffers.clear()
        self._mg_errors.clear()
        return n

    def moe_grpo_break_capture(self, on: bool) -> bool:
        """Tests only: expect routing from a layer that does not exist (999), as a broken router hook would look."""
        self._mg_layers = [layer for layer in self._mg_layers if layer != 999] + ([999] if on else [])
        return on

    def moe_grpo_set_reload_patch(self, on: bool) -> bool:
        """Tests only: show that reloading experts on CPU is wrong without the vLLM patch."""
        if on:
            vllm_patches.apply_cpu_moe_reload_prepack()
        else:
            vllm_patches.revert("cpu_moe_reload_prepack")
        return on

    def moe_grpo_set_rotary_patch(self, on: bool) -> int:
        """Tests only: serve with or without the CPU rotary patch (DeepSeek-V2/V3 attention); returns modules rebound."""
        if on:
            vllm_patches.apply_cpu_rotary_multihead_3d()
        else:
            vllm_patches.revert("cpu_rotary_multihead_3d")
        return vllm_patches.rebind_rotary(self.model_runner.get_model())  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- weights
    def moe_grpo_reload_from_file(self, path: str) -> int:
        """Load every tensor of a safetensors file (HF names, whole modules) into the running model."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self._mg_keep_base(tensors)
        self.reload_weights(weights_iterator=iter(list(tensors.items())))  # type: ignore[attr-defined]
        return len(tensors)

    def moe_grpo_reload_bucket(self, source: dict) -> int:
        """Load one published bucket from what the transport handed over (`sync/transports.py: open_bucket`: a
        mapped shared-memory file, or a CUDA IPC buffer), without a copy."""
        from moe_grpo.sync.transports import open_bucket

        with open_bucket(source) as tensors:
            self._mg_keep_base(tensors)
            self.reload_weights(weights_iterator=iter(list(tensors.items())))  # type: ignore[attr-defined]
            return len(tensors)

    def moe_grpo_weight_digests(self) -> dict[str, str]:
        """sha256 of every parameter and buffer of the served model, as vLLM holds them (fused, repacked): two
        loads that leave the same bits give the same digests. A linear layer whose weight vLLM's CPU backend packed
        into a oneDNN / sgl-kernel handle (its parameter left empty) is read back through that handle
        (`packed_linear_weight`), so its digest is of the bits it computes with, not of an empty tensor."""
        import torch

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for module_name, module in model.named_modules():
            packed = packed_linear_weight(module)
            if packed is not None:
                tensors[f"{module_name}.weight" if module_name else "weight"] = packed
        return {name: hashlib.sha256(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
                                     ).hexdigest() for name, t in tensors.items()}

    # ---------------------------------------------------------------- LoRA, merged (rollout/lora_merge.py)
    def moe_grpo_lora_setup(self, adapted: list[str], model_dir: str) -> dict[str, int]:
        """Merge mode: keep an exact copy of W0 of every `adapted` HF weight in this worker's pipeline stage, read
        from the model directory the engine started from (a LoRA run's start directory holds the frozen base).
        Returns the copies' bytes and how many weights this worker merges ("bytes", "weights")."""
        from moe_grpo.checkpoint.hf_io import SafetensorsDir
        from moe_grpo.rollout.lora_merge import MergedWeights, on_stage

        start, end = self._mg_stage_layers()
        mine = [name for name in adapted if on_stage(name, start, end)]  # a pipeline stage merges its own layers
        self._mg_lora = MergedWeights(mine)
        files = SafetensorsDir(model_dir)
        files.require(mine)
        for name in mine:
            self._mg_lora.keep({name: files.get(name)})
        return {"bytes": self._mg_lora.nbytes, "weights": len(mine)}

    def _mg_stage_layers(self) -> tuple[int, int | None]:
        """The decoder layers this worker's pipeline stage holds, [start, end) (vLLM's `start_layer`/`end_layer` of
        the model's layer stack; (0, None): every layer)."""
        inner = getattr(self.model_runner.get_model(), "model", None)  # type: ignore[attr-defined]
        start, end = getattr(inner, "start_layer", None), getattr(inner, "end_layer", None)
        return (int(start), int(end)) if isinstance(start, int) and isinstance(end, int) else (0, None)

    def _mg_keep_base(self, tensors: dict) -> None:
        """Every full-weight load is the base (a LoRA run's base is frozen): refresh the copies of W0 it holds."""
        lora = getattr(self, "_mg_lora", None)
        if lora is not None:
            lora.keep(tensors)

    def moe_grpo_merge_adapter(self, sources: list[dict], scale: float) -> int:
        """Serve W0 + scale * B @ A for the adapters in `sources` (published buckets, as `open_bucket` takes them,
        or {"kind": "safetensors", "path": ...}: a PEFT adapter file). Returns the HF weights reloaded."""
        from safetensors.torch import load_file

        from moe_grpo.sync.transports import open_bucket

        adapter: dict = {}
        with contextlib.ExitStack() as stack:
            for source in sources:
                if source.get("kind") == "safetensors":
                    adapter.update(load_file(source["path"]))
                else:
                    adapter.update(stack.enter_context(open_bucket(source)))
            return self.moe_grpo_apply_adapter(adapter, scale)

    def moe_grpo_apply_adapter(self, adapter: dict, scale: float) -> int:
        """The merge itself: one version's adapters (PEFT names -> whole A / B) and scale alpha / r in, the merged
        weights reloaded one decoder layer at a time. Never accumulates: W comes from the copy of W0."""
        from moe_grpo.rollout.lora_merge import adapter_weight, on_stage

        lora = getattr(self, "_mg_lora", None)
        if lora is None:
            raise RuntimeError("moe_grpo_apply_adapter before moe_grpo_lora_setup (the engine was started "
                               "without lora)")
        weight_of = {key: adapter_weight(key)[0] for key in adapter}
        start, end = self._mg_stage_layers()
        mine = {key: t for key, t in adapter.items() if on_stage(weight_of[key], start, end)}
        for group in lora.merged(mine, float(scale)):
            self.reload_weights(weights_iterator=iter(list(group.items())))  # type: ignore[attr-defined]
        return len(set(weight_of.values()))  # the version's adapted weights: every worker answers the same count


PACKED_READBACK_ROWS = 1024
"""Rows of the identity matrix sent through a packed linear at a time (`packed_linear_weight`): bounds its memory."""


def packed_linear_weight(module: Any) -> Any:
    """The weight [out, in] a linear layer computes with when vLLM's CPU backend (vLLM 0.32,
    `dispatch_cpu_unquantized_gemm`) packed it into a kernel handle and left `module.weight` empty; None for any
    other module. Read back exactly by sending the identity through the layer without its bias: row j of the
    output is 1 * W[:, j] plus exact zeros."""
    import torch

    cpu_linear, weight = getattr(module, "cpu_linear", None), getattr(module, "weight", None)
    if cpu_linear is None or not isinstance(weight, torch.Tensor) or weight.numel() != 0:
        return None
    in_features = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
    if not in_features:
        return None
    rows = []
    for start in range(0, in_features, PACKED_READBACK_ROWS):
        stop = min(start + PACKED_READBACK_ROWS, in_features)
        eye = torch.zeros(stop - start, in_features, dtype=weight.dtype)
        eye[torch.arange(stop - start), torch.arange(start, stop)] = 1
        rows.append(cpu_linear(eye, weight, None))
    return torch.cat(rows).t().contiguous()
