"""Low-rank adapters (LoRA) on the Megatron learner's linear layers, for megatron-core 0.16.1 without Transformer Engine.

megatron-core has no LoRA of its own and Megatron-Bridge's PEFT needs Transformer Engine, so this module adds
adapters to the local spec's `ColumnParallelLinear` / `RowParallelLinear` layers (attention qkv / proj, dense
MLP fc1 / fc2, and inside `SequentialMLP` each routed expert's fc1 / fc2, the shared experts' fc1 / fc2).

How (decisions, and why):

- **Attached, not wrapped.** Each adapted linear layer gets a child module `lora` (so its parameters are named
  `<layer>.lora.A.<piece>` / `<layer>.lora.B.<piece>`) and a forward hook that adds `(alpha/r) B A dropout(x)` to
  the layer's output. Replacing the layers would rename every base parameter, which the HF name map, the weight
  sync, checkpoints and routing replay all address by name.
- **One adapter per HF target, exact PEFT export.** Megatron fuses q, k, v into `linear_qkv` (interleaved per
  query group) and gate, up into `linear_fc1` (`[gate; up]`); PEFT's adapters target HF's `q_proj`, `k_proj`,
  `v_proj`, `gate_proj`, `up_proj` separately. A fused layer therefore holds one (A, B) pair per HF target
  ("piece": q/k/v or gate/up; "w" for unfused layers) and interleaves the pieces' outputs as the base weight is
  laid out. The PEFT export is then a rename, with no approximation, and a PEFT adapter loads exactly.
- **Tensor parallel.** A column-parallel layer (weight sharded on its output dim) keeps A `[r, in]` whole on every
  rank and shards each B `[out, r]` on its output dim like the base weight (for qkv by query group, for gate/up
  each of gate and up, as Megatron shards them). A row-parallel layer (sharded on its input dim) shards A on its
  input dim and keeps B whole; the partial `A x` (r values per token, not `out`) is reduced before B is applied.
  Where the rank-local gradient of a replicated factor is only a partial sum (sequence parallel, where each rank
  sees a slice of the tokens; and expert layers, whose communication the token dispatcher does), the factor goes
  through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of its gradient backward), so every
  rank holds the same, complete gradient and no `sequence_parallel` bookkeeping is needed.
- **Expert parallel.** Adapters live in the expert's own module, so each rank holds the adapters of its local
  experts; they inherit the base weight's `allreduce` flag, so Megatron's DDP reduces their gradients over the
  expert-data-parallel group and the optimizer puts them into its expert part.
- **Pipeline parallel.** Adapters live in their layer, so each stage holds its own layers' adapters.
- **Layout-independent initialisation.** B starts at zero (step 0 is the base model exactly) and A as PEFT's
  default (`kaiming_uniform_(a=sqrt(5))`, i.e. uniform in +-1/sqrt(in)), drawn from a generator seeded by the
  learner seed and the adapter's global (TP=EP=PP=1) name and sliced for this rank, so every layout starts from
  the same adapters.
- **Frozen base.** Every base parameter (embeddings, norms, output layer, router) gets `requires_grad=False` and
  keeps the model's dtype; Megatron's DDP allocates gradient buffers and the optimizer state only for parameters
  that require gradients, i.e. the adapters. Adapters are built in the model's dtype (Megatron's mixed-precision
  optimizer keeps their fp32 main copies on GPU).
- **The router stays frozen and full-rank, without an adapter.** Under rollout routing replay (R3) the learner
  routes tokens as the engine did, so a trainable router would be trained against routing it does not choose,
  and any change to it makes the engines' routing drift from the learner's (the mismatch R3 removes); the
  aux-loss-free expert bias update is switched off for the same reason (`MegatronLearner`). Adapter-only weight
  sync must not ship router weights either. verl's and the LoRA-for-MoE practice is the same (router frozen).
- **Dropout** uses one mask per fused layer (PEFT draws one per target) from torch's default generator; with
  dropout > 0 a step is not layout-invariant (masks differ), as Megatron's own hidden dropout is not.

Checkpoints: the layer's `sharded_state_dict` gains the adapters with their TP axis, so Megatron's distributed
checkpoint reshards them with the model (save/load at another layout). `gather_adapter_state` /
`load_adapter_state` move adapters in PEFT's naming between a learner of any layout and full tensors
(checkpoint/peft.py reads and writes PEFT's directory format).
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any, Callable

import torch
import torch.distributed as dist

from moe_grpo.learner.lora_config import LoraConfig
from moe_grpo.models.hf_names import ParamMapping, hf_shapes
from moe_grpo.models.peft_names import PEFT_PREFIX, adapter_sites, peft_key, peft_shapes
from moe_grpo.models.spec import MoEModelSpec

PIECES = {"copy": ("w",), "gate_up": ("gate", "up"), "qkv": ("q", "k", "v")}
"""The adapter pieces of a Megatron linear layer, by the kind of its HF name map (one per HF tensor, in order)."""

def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear layer: one (A, B) pair per HF target it fuses (see the module docstring).

    `forward(x)` takes the layer's input and returns what to add to the layer's output (already scaled)."""

    def __init__(self, linear: Any, mapping: ParamMapping, global_name: str, spec: MoEModelSpec, config: LoraConfig,
                 hf_shapes: dict[str, tuple[int, ...]], seed: int) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        if isinstance(linear, ColumnParallelLinear):
            self.parallel = "column"
            if linear.gather_output:
                raise ValueError(f"{global_name}: LoRA on a column-parallel layer that gathers its output is not built")
        elif isinstance(linear, RowParallelLinear):
            self.parallel = "row"
            if not linear.input_is_parallel:
                raise ValueError(f"{global_name}: LoRA on a row-parallel layer whose input is not parallel is not built")
        else:
            raise TypeError(f"{global_name} is a {type(linear).__name__}, expected a Column/RowParallelLinear")
        self.global_name, self.mapping, self.kind = global_name, mapping, mapping.kind
        self.pieces = PIECES[mapping.kind]
        self.rank_r, self.scale = config.rank, config.scale
        self.group = linear.tp_group
        self.tp, self.tp_rank = self.group.size(), self.group.rank()
        self.explicit_comm = bool(getattr(linear, "explicit_expert_comm", False))
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", False)) and self.tp > 1
        if self.parallel == "column" and self.kind != "copy" and self.tp > 1 and self.kind == "qkv":
            if spec.query_groups % self.tp:
                raise ValueError(f"{global_name}: {spec.query_groups} query groups do not split over TP={self.tp}")
        self.query_groups, self.heads, self.head_dim = spec.query_groups, spec.num_attention_heads, spec.kv_channels
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout > 0 else torch.nn.Identity()
        weight = linear.weight
        dtype, device = weight.dtype, weight.device
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        rows_local = 0
        for piece, hf in zip(self.pieces, mapping.hf):
            out_full, in_full = hf_shapes[hf]
            gen = torch.Generator().manual_seed(_seed(seed, f"{global_name}.{piece}"))
            bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)) on [r, in], PEFT's default for A
            a_full = torch.empty(config.rank, in_full).uniform_(-bound, bound, generator=gen)
            b_full = torch.zeros(out_full, config.rank)
            if self.parallel == "column":
                a, b = a_full, b_full.chunk(self.tp, dim=0)[self.tp_rank]
                rows_local += b.shape[0]
            else:
                a, b = a_full.chunk(self.tp, dim=1)[self.tp_rank], b_full
                if a.shape[1] != weight.shape[1]:
                    raise ValueError(f"{global_name}: adapter A shard {tuple(a.shape)} does not fit the weight "
                                     f"{tuple(weight.shape)}")
            self.A[piece] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.B[piece] = torch.nn.Parameter(b.to(device=device, dtype=dtype).contiguous())
        if self.parallel == "column" and (rows_local != weight.shape[0] or in_full != weight.shape[1]):
            raise ValueError(f"{global_name}: adapter pieces give [{rows_local}, {in_full}] on this rank, the weight "
                             f"is {tuple(weight.shape)}")
        allreduce = getattr(weight, "allreduce", True)  # False for expert weights under EP: expert-DP reduction
        sharded = self.B if self.parallel == "column" else self.A
        for params in (self.A, self.B):
            for p in params.values():
                p.allreduce = allreduce
                if params is sharded and self.tp > 1:  # counted once per shard by the grad-norm (not a TP duplicate)
                    p.tensor_model_parallel = True
                    p.partition_dim = 0 if self.parallel == "column" else 1
                    p.partition_stride = 1

    def sharded_axes(self) -> dict[str, int]:
        """State-dict key -> the axis it is sharded on across TP (Megatron's `tensor_parallel_layers_axis_map`)."""
        if self.parallel == "column":
            return {f"B.{p}": 0 for p in self.pieces}
        return {f"A.{p}": 1 for p in self.pieces}

    def _combine(self, ys: list[torch.Tensor]) -> torch.Tensor:
        """Lay the pieces' outputs out as the fused base weight's rows are (this rank's shard)."""
        if self.kind == "copy":
            return ys[0]
        if self.kind == "gate_up":
            return torch.cat(ys, dim=-1)
        groups = self.query_groups // (self.tp if self.parallel == "column" else 1)
        q, k, v = (y.reshape(*y.shape[:-1], groups, -1) for y in ys)
        out = torch.cat([q, k, v], dim=-1)
        return out.reshape(*out.shape[:-2], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region,
                                                            reduce_from_tensor_model_parallel_region,
                                                            reduce_scatter_to_sequence_parallel_region)

        r = self.rank_r
        x = self.dropout(x)
        a = torch.cat([self.A[p] for p in self.pieces], dim=0)  # [pieces * r, in (local for row-parallel)]
        bs = [self.B[p] for p in self.pieces]
        tp, group = self.tp, self.group
        if self.parallel == "column":
            if tp > 1 and (self.explicit_comm or self.sequence_parallel):
                a = copy_to_tensor_model_parallel_region(a, group=group)  # rank-local grad of A is a partial sum
            h = x @ a.t()
            if tp > 1 and not self.explicit_comm:
                if self.sequence_parallel:  # x holds this rank's tokens; the base output holds all of them
                    h = gather_from_sequence_parallel_region(h, group=group)
                else:  # x is replicated; the base's input gradient is all-reduced inside the layer, do the same
                    h = copy_to_tensor_model_parallel_region(h, group=group)
            ys = [h[..., i * r:(i + 1) * r] @ b.t() for i, b in enumerate(bs)]
        else:
            h = x @ a.t()  # partial sum over this rank's input slice
            if tp > 1:
                if self.explicit_comm:  # the dispatcher sums the expert's partial output, this with it
                    bs = [copy_to_tensor_model_parallel_region(b, group=group) for b in bs]
                elif self.sequence_parallel:  # the base output is reduce-scattered over tokens
                    h = reduce_scatter_to_sequence_parallel_region(h, group=group)
                    bs = [copy_to_tensor_model_parallel_region(b, group=group) for b in bs]
                else:  # the base output is all-reduced: add B (sum of h) after it, once
                    h = reduce_from_tensor_model_parallel_region(h, group=group)
            ys = [h @ bs[0].t()]
        return self._combine(ys) * self.scale


def _add_adapter_output(linear: Any, args: tuple, output: Any) -> Any:
    """Forward hook on an adapted layer: its (output, bias) with the adapter's term added to the output."""
    out, bias = output
    return out + linear.lora(args[0]).to(out.dtype), bias


def _with_adapter_sharding(linear: Any, base: Callable[..., Any]) -> Callable[..., Any]:
    """The layer's `sharded_state_dict` with the adapters sharded on their own TP axis (the base method would save
    every tensor it does not know as replicated)."""

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = base(prefix, sharded_offsets, metadata)
        own = f"{prefix}lora."
        for key in [k for k in out if k.startswith(own)]:
            del out[key]
        state = linear.lora.state_dict(prefix="", keep_vars=True)
        out.update(make_sharded_tensors_for_checkpoint(state, own, linear.lora.sharded_axes(), sharded_offsets,
                                                       tp_group=linear.tp_group,
                                                       dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return out

    return sharded_state_dict


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def global_module_name(module: Any, local_name: str) -> str:
    """A module's name in the TP=EP=PP=1 model: this stage's layer index -> the global one, this rank's expert
    index -> the global one."""
    from megatron.core import parallel_state as ps

    name = local_name
    m = _LAYER_RE.match(name)
    if m:
        layer = module.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
        e = _EXPERT_RE.search(name)
        if e:
            experts = layer.mlp.experts.local_experts
            idx = int(e.group(1)) + ps.get_expert_model_parallel_rank() * len(experts)
            name = name[:e.start()] + f".mlp.experts.local_experts.{idx}." + name[e.end():]
    return name


def apply_lora(module: Any, spec: MoEModelSpec, config: LoraConfig, *, seed: int) -> dict[str, LoraAdapter]:
    """Freeze every parameter of `module` (this rank's GPTModel) and attach adapters to its targeted linear layers.

    Call before Megatron's DDP wraps the model (DDP and the optimizer then hold the adapters only). Returns
    {global module name: adapter} for this rank's adapters."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if not config.enabled:
        raise ValueError("apply_lora with lora.rank=0 (adapters off)")
    sites = adapter_sites(spec, config)
    shapes = hf_shapes(spec)
    for p in module.parameters():
        p.requires_grad_(False)
    adapters: dict[str, LoraAdapter] = {}
    for name, layer in list(module.named_modules()):
        if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            continue
        global_name = global_module_name(module, name)
        mapping = sites.get(global_name)
        if mapping is None:
            continue
        if spec.uses_mla and ".self_attention." in global_name and layer.tp_group.size() > 1:
            raise ValueError("lora.targets with 'attention' on an MLA model needs tensor_parallel=1 (its replicated "
                             "down projections are not handled); drop 'attention' or use TP=1")
        adapter = LoraAdapter(layer, mapping, global_name, spec, config, shapes, seed)
        layer.add_module("lora", adapter)
        layer.register_forward_hook(_add_adapter_output)
        layer.sharded_state_dict = _with_adapter_sharding(layer, layer.sharded_state_dict)
        adapters[global_name] = adapter
    return adapters


# --------------------------------------------------------------------------- adapters <-> full tensors (PEFT names)


def _local_pieces(adapters: dict[str, LoraAdapter]) -> list[tuple[str, str, int | None, int, torch.Tensor]]:
    """(PEFT key, factor, shard axis or None, TP rank, local tensor) of every piece on this rank."""
    out = []
    for adapter in adapters.values():
        axis_a = 1 if adapter.parallel == "row" and adapter.tp > 1 else None
        axis_b = 0 if adapter.parallel == "column" and adapter.tp > 1 else None
        for piece, hf in zip(adapter.pieces, adapter.mapping.hf):
            out.append((peft_key(hf, "A"), "A", axis_a, adapter.tp_rank, adapter.A[piece].detach().cpu()))
            out.append((peft_key(hf, "B"), "B", axis_b, adapter.tp_rank, adapter.B[piece].detach().cpu()))
    return out


def gather_adapter_state(adapters: dict[str, LoraAdapter], spec: MoEModelSpec,
                         config: LoraConfig) -> dict[str, torch.Tensor]:
    """Collective: every adapter tensor of the model, whole, in PEFT's naming (on every rank).

    Adapters are small (r * (in + out) per layer), so each rank's pieces travel as objects; TP shards are
    concatenated in TP order, data-parallel replicas are taken once."""
    mine = _local_pieces(adapters)
    everyone: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    shards: dict[str, dict[int, torch.Tensor]] = {}
    axes: dict[str, int | None] = {}
    for pieces in everyone:
        for key, _, axis, tp_rank, tensor in pieces:
            shards.setdefault(key, {}).setdefault(tp_rank, tensor)
            axes[key] = axis
    out = {}
    for key, parts in shards.items():
        axis = axes[key]
        out[key] = parts[0] if axis is None else torch.cat([parts[i] for i in sorted(parts)], dim=axis)
    expected = peft_shapes(spec, config)
    missing = sorted(set(expected) - set(out))
    if missing:
        raise RuntimeError(f"adapters missing from every rank: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for key, shape in expected.items():
        if tuple(out[key].shape) != shape:
            raise RuntimeError(f"{key}: gathered shape {tuple(out[key].shape)}, expected {shape}")
    return {key: out[key] for key in expected}


@torch.no_grad()
def load_adapter_state(adapters: dict[str, LoraAdapter], state: dict[str, torch.Tensor], spec: MoEModelSpec,
                       config: LoraConfig) -> None:
    """Set this rank's adapters from whole tensors in PEFT's naming (each rank takes its shard). `state` must hold
    exactly the model's adapter tensors (`peft_shapes`) with their shapes; the error names what differs."""
    expected = peft_shapes(spec, config)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"the adapter does not fit lora.targets={list(config.targets)} of this model: missing "
                         f"{missing[:4]}{' ...' if len(missing) > 4 else ''} ({len(missing)}), unexpected "
                         f"{extra[:4]}{' ...' if len(extra) > 4 else ''} ({len(extra)})")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"{key} has shape {tuple(state[key].shape)}, expected {shape} (lora.rank={config.rank})")
    for adapter in adapters.values():
        for piece, hf in zip(adapter.pieces, adapter.mapping.hf):
            a, b = state[peft_key(hf, "A")], state[peft_key(hf, "B")]
            if adapter.parallel == "column":
                b = b.chunk(adapter.tp, dim=0)[adapter.tp_rank]
            else:
                a = a.chunk(adapter.tp, dim=1)[adapter.tp_rank]
            adapter.A[piece].copy_(a)
            adapter.B[piece].copy_(b)


def merge_into_hf(hf_state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """HF weights with each adapter folded in: `W + scale * B @ A` (computed in fp32, stored in W's dtype), for every
    (A, B) pair in `adapter` (PEFT naming) whose base weight is in `hf_state`; other tensors are returned as they are.
    Raises when an adapter's base weight is absent or its shape does not fit."""
    out = dict(hf_state)
    for key in adapter:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        name = f"{module}.weight"
        if name not in out:
            raise KeyError(f"the adapter's {key} has no base weight {name!r}")
        a, b = adapter[key].float(), adapter[f"{PEFT_PREFIX}{module}.lora_B.weight"].float()
        w = out[name]
        delta = scale * (b @ a)
        if tuple(delta.shape) != tuple(w.shape):
            raise ValueError(f"{module}: B @ A is {tuple(delta.shape)}, the base weight {tuple(w.shape)}")
        out[name] = (w.float() + delta).to(w.dtype)
    return out
