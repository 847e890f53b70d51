"""How much GPU memory a learner rank and an engine GPU need: an estimate the plan checks before anything starts.

Learner rank (the pipeline stage that needs most):

- weights: the stage's parameters this rank holds, in `megatron.params_dtype`. Attention projections, dense MLPs
  and shared experts split over TP; routed experts over EP x TP (Megatron's expert tensor-parallel size is TP);
  norms, routers and MLA's down-projections whole (models/param_count.py); the embedding on the first stage and
  the output layer on the last, split over TP.
- gradients: the same count, 4 bytes each with `megatron.grad_reduce_in_fp32` (Megatron's main_grad buffer), else
  the weights' size.
- Adam: fp32 main parameters (only when the weights are not fp32) and two fp32 moments: 12 or 8 bytes per
  parameter. `megatron.distributed_optimizer` shards them over the data-parallel ranks (dense parts) and the
  expert-data-parallel ranks (routed experts), as Megatron's distributed optimizer does; gradients and weights
  are not sharded by it.
- the KL reference (`algo.kl_coef > 0`): one more copy of the weights (`MegatronLearner.set_reference`).
- the mismatch probe (on by default: `routing.probe_prompts > 0` and `routing.probe_every > 0`): `PROBE_SNAPSHOTS`
  copies of the rank's weights, the published versions `MegatronLearner.snapshot_weights` keeps until an engine's
  samples of them come back.
- `sync.transport=cuda_ipc`: `sync.slots` whole versions of the model, in the engines' dtype, as CUDA buffers
  owned by learner rank 0 (sync/cuda_ipc.py), on the first pipeline stage's rank 0 only.
- activations, per micro-batch and layer, from Korthikanti et al. 2022 ("Reducing Activation Recomputation in
  Large Transformer Models"): 34·s·b·h bytes at 2-byte activations with flash attention, divided by TP with
  sequence parallelism, where the MLP's part (19·s·b·h for a 4h MLP) is replaced in MoE layers by each routed
  copy's SwiGLU activations (2h + 6f bytes per token per copy, top_k copies plus the shared experts):
  MoE layer 15h + top_k(2h + 6f) (+ 2h + 6f_shared); dense layer 15h + 2h + 6F. With `megatron.recompute`
  (full recompute) a layer keeps only its input (2·s·b·h/TP) plus one layer's full set while it recomputes.
  Under 1F1B the first stage holds PP micro-batches at once, stage k PP - k. Plus the logits in fp32 and their
  gradient on the last stage (8·s·b·vocab/TP bytes).
- `RESERVED_GIB` per GPU for the CUDA context, NCCL's buffers and the allocator's fragmentation.

Engine GPU: the model's weights in `rollout.dtype` divided by the engine's tensor x pipeline parallelism, against vLLM's
default `gpu_memory_utilization` (0.9) of the GPU less `RESERVED_GIB`; what is left is the KV cache.

Estimates, not measurements: they catch plans that cannot fit (DeepSeek-V3 with Adam on 32 80-GiB GPUs needs
several times what exists), not the last few GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_grpo.models.param_count import ParamCounts
from moe_grpo.models.spec import MoEModelSpec

GIB = 1 << 30
RESERVED_GIB = 4.0
"""Per GPU, outside the estimate: CUDA context (~0.5-1 GiB), NCCL buffers, allocator fragmentation."""
VLLM_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default share of a GPU for weights + KV cache (the engines do not change it)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROBE_SNAPSHOTS = 2
"""Copies of a rank's weights the mismatch probe keeps: learner/probe_copies.py's MAX_SNAPSHOTS (not imported:
that module loads torch and Megatron, and a dry run loads neither; a test checks the two agree)."""


@dataclass(frozen=True)
class RankMemory:
    """One learner rank's estimate, in bytes (the pipeline stage that needs most)."""

    stage: int
    params: int
    """Parameters this rank holds."""
    weights: int
    grads: int
    optimizer: int
    reference: int
    activations: int
    probe: int
    """The mismatch probe's copies of the weights (0: the probe is off)."""
    sync_slots: int
    """`sync.transport=cuda_ipc`'s whole-model buffers on rank 0 (0: another transport, or not rank 0's stage)."""
    capacity: int
    """The GPU's memory less RESERVED_GIB."""
    details: str
    """How each term was computed, for the printed plan."""

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer + self.reference + self.activations + self.probe
                + self.sync_slots)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def terms(self) -> str:
        return (f"weights {gib(self.weights)} + grads {gib(self.grads)} + Adam {gib(self.optimizer)}"
                + (f" + KL reference {gib(self.reference)}" if self.reference else "")
                + f" + activations {gib(self.activations)}"
                + (f" + mismatch probe {gib(self.probe)}" if self.probe else "")
                + (f" + cuda_ipc slots {gib(self.sync_slots)} on rank 0" if self.sync_slots else ""))

    def line(self) -> str:
        return (f"{self.terms()} = {gib(self.total)} of {gib(self.capacity)} usable (pipeline stage {self.stage}, "
                f"{_count(self.params)} parameters on the rank)")


@dataclass(frozen=True)
class EngineMemory:
    """One engine GPU's estimate, in bytes."""

    weights: int
    capacity: int
    """vLLM's share of the GPU less RESERVED_GIB."""

    @property
    def fits(self) -> bool:
        return self.weights < self.capacity

    def line(self) -> str:
        left = self.capacity - self.weights
        return (f"weights {gib(self.weights)} of {gib(self.capacity)} usable "
                + (f"({gib(left)} left for the KV cache)" if left > 0 else f"({gib(-left)} short)"))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 or n == 0 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class TrainingShape:
    """What the learner's memory depends on besides the model and the layout."""

    params_dtype: str = "float32"
    grad_reduce_in_fp32: bool = True
    distributed_optimizer: bool = False
    recompute: bool = False
    kl_reference: bool = False
    micro_batch: int = 1
    """Sequences (or packed rows) per micro-batch."""
    seq_len: int = 1
    """Positions per sequence (or packed row)."""
    probe: bool = False
    """Whether the mismatch probe runs (`routing.probe_prompts > 0` and `routing.probe_every > 0`)."""
    cuda_ipc_slots: int = 0
    """Whole versions `sync.transport=cuda_ipc` keeps in rank 0's GPU memory (`sync.slots`); 0 for other
    transports."""
    sync_dtype: str = "float32"
    """What a version travels in (sync/dtypes.py `version_dtype`): the size of each cuda_ipc slot's elements."""


def rank_memory(spec: MoEModelSpec, counts: ParamCounts, tp: int, pp: int, ep: int, dp: int,
                shape: TrainingShape, gpu_memory_bytes: float) -> RankMemory:
    """The estimate of the module docstring for the stage that needs most (`dp`: data-parallel size)."""
    edp = max(1, (tp * pp * dp) // (tp * ep * pp))  # Megatron's expert-data-parallel size (expert TP = TP)
    wbytes = DTYPE_BYTES[shape.params_dtype]
    gbytes = 4 if shape.grad_reduce_in_fp32 or wbytes == 4 else wbytes
    obytes = 8 if wbytes == 4 else 12
    abytes = 4 if wbytes == 4 else 2
    per_stage = len(counts.layers) // pp
    tokens = shape.micro_batch * shape.seq_len
    h = spec.hidden_size
    best: RankMemory | None = None
    for stage in range(pp):
        layers = counts.layers[stage * per_stage:(stage + 1) * per_stage]
        first = stage * per_stage
        dense = sum(layer.tp_split for layer in layers) / tp + sum(layer.replicated for layer in layers)
        if stage == 0:
            dense += counts.embedding / tp
        if stage == pp - 1:
            dense += counts.output / tp + counts.final_norm
        experts = sum(layer.routed for layer in layers) / (ep * tp)
        params = dense + experts
        opt_dense, opt_experts = dense * obytes, experts * obytes
        if shape.distributed_optimizer:
            opt_dense, opt_experts = opt_dense / dp, opt_experts / edp
        per_layer = []
        for i in range(first, first + len(layers)):
            if i < spec.first_k_dense:
                mlp = 2 * h + 6 * spec.ffn_hidden_size
            else:
                mlp = spec.top_k * (2 * h + 6 * spec.moe_ffn_hidden_size)
                if spec.num_shared_experts:
                    mlp += 2 * h + 6 * int(spec.shared_expert_hidden_size or 0)
            per_layer.append(tokens * (15 * h + mlp) / 2 * abytes / tp)
        if shape.recompute:
            one_microbatch = len(layers) * tokens * abytes * h / tp + max(per_layer, default=0)
        else:
            one_microbatch = sum(per_layer)
        in_flight = pp - stage  # 1F1B: stage k holds PP - k micro-batches
        activations = one_microbatch * in_flight
        if stage == pp - 1:
            activations += 8 * tokens * spec.vocab_size / tp
        probe = PROBE_SNAPSHOTS * params * wbytes if shape.probe else 0
        sbytes = DTYPE_BYTES[shape.sync_dtype]
        sync_slots = shape.cuda_ipc_slots * counts.total * sbytes if stage == 0 else 0
        memory = RankMemory(
            stage=stage, params=int(params), weights=int(params * wbytes), grads=int(params * gbytes),
            optimizer=int(opt_dense + opt_experts), reference=int(params * wbytes) if shape.kl_reference else 0,
            activations=int(activations), probe=int(probe), sync_slots=int(sync_slots),
            capacity=int(gpu_memory_bytes - RESERVED_GIB * GIB),
            details=(f"{shape.params_dtype} weights, {'fp32' if gbytes == 4 else shape.params_dtype} grads, "
                     f"Adam {obytes} bytes/parameter"
                     + (f" sharded over DP {dp} (dense) / expert DP {edp} (experts)" if shape.distributed_optimizer
                        else " (megatron.distributed_optimizer=false: not sharded)")
                     + f"; activations for micro-batch {shape.micro_batch} x {shape.seq_len} positions, "
                     f"{len(layers)} layers x {in_flight} micro-batch(es) in flight"
                     + (", full recompute" if shape.recompute else "")
                     + (f"; mismatch probe: {PROBE_SNAPSHOTS} copies of the weights" if shape.probe else
                        "; mismatch probe off (routing.probe_prompts=0 or routing.probe_every=0): no copies")
                     + (f"; sync.transport=cuda_ipc: {shape.cuda_ipc_slots} whole-model slots "
                        f"({_count(counts.total)} parameters x {sbytes} bytes each, {shape.sync_dtype}) on rank 0"
                        if sync_slots else "")))
        if best is None or memory.total > best.total:
            best = memory
    assert best is not None
    return best


def engine_memory(total_params: int, dtype: str, tensor_parallel: int, gpu_memory_bytes: float,
                  pipeline_parallel: int = 1) -> EngineMemory:
    """Each engine GPU's share of the weights vs what vLLM may use of it (module docstring): the weights over the
    engine's tensor_parallel x pipeline_parallel GPUs (each stage holds its run of layers, each TP rank its
    slices). vLLM's expert parallelism inside the engine (cluster.engine_expert_parallel, `enable_expert_parallel`)
    needs no term of its own: it gives each of the same TP workers 1/TP of the routed experts whole instead of 1/TP
    of each expert, the same bytes per GPU (up to one expert where TP does not divide the expert count)."""
    return EngineMemory(int(total_params * DTYPE_BYTES[dtype] / (tensor_parallel * pipeline_parallel)),
                        int(gpu_memory_bytes * VLLM_GPU_MEMORY_UTILIZATION - RESERVED_GIB * GIB))
