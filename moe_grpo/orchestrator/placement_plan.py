"""The placement plan: which node runs which engine and which learner ranks, checked before anything starts.

`build_plan(run, environ)` is a pure function of the run's config and the environment (SLURM's variables or this
host, orchestrator/cluster_env.py). It decides

- the nodes of each pool: `cluster=slurm` splits the job's nodes into a training pool (the first nodes: learner
  rank 0 and its rendezvous next to the driver) and an inference pool (the next ones); `cluster=local` keeps
  both on this host (or leaves them to Ray on a joined cluster), as before;
- each engine's node (or, wider than a node, its stages' nodes: orchestrator/engine_span.py) and parallelism,
  each learner rank's node and Megatron coordinates (TP, PP, DP, EP and
  expert DP, in megatron-core 0.16.1's default order tp-cp-ep-dp-pp);
- the bytes a weight sync moves per engine host (every engine host receives the whole model once per version, in
  the engines' dtype: sync/dtypes.py `version_dtype`), and each pool's memory estimate
  (orchestrator/memory_estimate.py);
- under SLURM, a run checkpoint's size and write time beside `--signal`'s warning time, with a warning when it does
  not fit (orchestrator/checkpoint_time.py);

and refuses, with the reason and the numbers, a plan that cannot run: more GPUs than the nodes have, a learner
world Megatron cannot split (world = TP x PP x DP, TP x EP x PP dividing the world, EP dividing the expert count,
PP the layer count, TP the attention heads), a training pool the world does not fill, an engine whose stages cannot lie whole on whole nodes (or wider than a
node on CPU),
a model whose estimate does not fit the GPUs. The driver prints it before the pools start;
`cluster.dry_run=true` prints it and exits.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from moe_grpo.data.tokenizer import load_tokenizer
from moe_grpo.models.options import gloo_dispatcher_problem
from moe_grpo.models.param_count import param_counts
from moe_grpo.models.peft_names import peft_shapes
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.orchestrator.checkpoint_time import CheckpointTime, checkpoint_bytes, measure_write_gbps
from moe_grpo.orchestrator.cluster_env import (NodeFacts, RunCommand, local_facts, run_command_stdout, signal_warning_s,
                                               slurm_facts)
from moe_grpo.orchestrator.config import ClusterConfig
from moe_grpo.orchestrator.engine_span import RAY_ON_CPU_REFUSAL, EngineSpan, engine_span
from moe_grpo.orchestrator.memory_estimate import (DTYPE_BYTES, GIB, RESERVED_GIB, EngineMemory, RankMemory,
                                                   TrainingShape, engine_memory, rank_memory)
from moe_grpo.orchestrator.run_prompts import engine_context, prompt_source
from moe_grpo.rollout.engine_core_start import cpu_build_installed
from moe_grpo.rollout.vllm_cpu_limits import CPU_EXPERT_PARALLEL_SEGFAULT
from moe_grpo.sync.dtypes import version_dtype

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig


class PlanRefused(ValueError):
    """The plan cannot run; the message lists every reason."""


@dataclass(frozen=True)
class EnginePlacement:
    name: str
    node: str | None
    """None: no node has room for it (a problem names it)."""
    tensor_parallel: int
    gpus: float
    cpus: float
    pipeline_parallel: int = 1
    """vLLM pipeline stages (cluster.engine_pipeline_parallel): on `node`, or over `worker_nodes`."""
    expert_parallel: bool = False
    """vLLM expert parallelism (cluster.engine_expert_parallel): the routed experts sharded whole over the
    `tensor_parallel` workers (EP = TP), on the same GPUs."""
    worker_nodes: tuple[str, ...] = ()
    """The node of each vLLM worker, in vLLM's rank order (stage-major), when the engine's stages span nodes
    (orchestrator/engine_span.py; vLLM's Ray executor, one placement bundle per worker); empty: every worker on
    `node` (vLLM's multiprocessing executor)."""

    @property
    def spans_nodes(self) -> bool:
        return len(set(self.worker_nodes)) > 1

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node holding a worker of this engine, stage 0's first."""
        return tuple(dict.fromkeys(self.worker_nodes)) if self.worker_nodes else (self.node,) if self.node else ()

    @property
    def actor_gpus(self) -> float:
        """GPUs the engine's actor reserves itself: all of them on one node (its multiprocessing workers inherit
        them), none when its stages span nodes (vLLM's Ray workers take theirs from the engine's bundles)."""
        return 0.0 if self.spans_nodes else self.gpus


@dataclass(frozen=True)
class RankPlacement:
    """A learner rank, its node and its Megatron coordinates."""

    rank: int
    node: str | None
    tp: int
    pp: int
    dp: int
    ep: int
    edp: int
    """Expert-data-parallel rank (the group the experts' gradients are reduced over)."""

    def label(self) -> str:
        return f"r{self.rank}[tp{self.tp} pp{self.pp} dp{self.dp} ep{self.ep}]"


@dataclass(frozen=True)
class Layout:
    """Megatron's split of the learner world."""

    world: int
    tp: int
    pp: int
    dp: int
    ep: int

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    def text(self) -> str:
        return f"TP={self.tp} PP={self.pp} DP={self.dp} EP={self.ep} (expert DP {self.edp})"


def coordinates(rank: int, layout: Layout) -> tuple[int, int, int, int, int]:
    """(tp, pp, dp, ep, edp) of `rank`, as megatron-core 0.16.1's RankGenerator assigns them with its default order
    'tp-cp-ep-dp-pp' (TP fastest, PP slowest; experts: expert TP = TP, then EP, then expert DP)."""
    tp = rank % layout.tp
    dp = (rank // layout.tp) % layout.dp
    pp = rank // (layout.tp * layout.dp)
    ep = (rank // layout.tp) % layout.ep
    edp = (rank // (layout.tp * layout.ep)) % layout.edp
    return tp, pp, dp, ep, edp


@dataclass(frozen=True)
class Plan:
    launcher: str
    facts: NodeFacts
    gpus_per_node: int | None
    cpus_per_node: int | None
    gpu_memory_gib: float
    model: str
    total_params: int
    routed_params: int
    training_nodes: tuple[str, ...]
    inference_nodes: tuple[str, ...]
    unused_nodes: tuple[str, ...]
    engines: tuple[EnginePlacement, ...]
    ranks: tuple[RankPlacement, ...]
    world: int
    layout: Layout | None
    """None when Megatron cannot split the world (a problem says why)."""
    rank_gpus: float
    """GPUs each learner rank holds."""
    sync_dtype: str
    sync_bytes: int
    """Bytes one version carries into each engine host (with LoRA: the first, base and adapters)."""
    rank_memory: RankMemory | None
    engine_memory: EngineMemory | None
    problems: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    checkpoint: CheckpointTime | None = None
    """A run checkpoint's size and write time vs SLURM's warning time (slurm plans)."""
    adapter_bytes: int | None = None
    """With LoRA: bytes of each version after the first (the adapters only); None without."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def pinned(self) -> bool:
        """Whether each engine and rank is pinned to its node (slurm); local plans leave placement to Ray."""
        return self.launcher == "slurm"

    @property
    def engine_hosts(self) -> list[str]:
        """Every node holding an engine worker (each receives every version once)."""
        return list(dict.fromkeys(n for e in self.engines for n in e.nodes))

    def engine_worker_nodes(self) -> list[list[str] | None]:
        """Per engine: the node of each of its vLLM workers when its stages span nodes (its own placement group,
        one bundle per worker: pools.start_pools), else None."""
        return [list(e.worker_nodes) if e.spans_nodes else None for e in self.engines]

    def bundle_nodes(self) -> list[str | None]:
        """The node each placement-group bundle must go to: engines first, then learner ranks (pools.start_pools'
        order); None for a local plan."""
        if not self.pinned:
            return [None] * (len(self.engines) + len(self.ranks))
        return [e.node for e in self.engines] + [r.node for r in self.ranks]

    def cluster_for_run(self, cluster: ClusterConfig) -> ClusterConfig:
        """`cluster` with what the plan decided filled in (slurm: the nodes, learner ranks, GPUs per engine and per
        rank); a local plan changes nothing."""
        if not self.pinned:
            return cluster
        engine_gpus = self.engines[0].actor_gpus if self.engines else cluster.engine_gpus
        return dataclasses.replace(cluster, nodes=self.facts.nodes, learner_ranks=self.world, engine_gpus=engine_gpus,
                                   learner_gpus=self.rank_gpus)

    def render(self) -> str:
        """The plan as the user reads it (the driver logs it; `cluster.dry_run=true` prints it)."""
        gpus = ", GPU count unknown" if self.gpus_per_node is None else f" x {_n(self.gpus_per_node, 'GPU')}"
        if self.gpus_per_node:
            gpus += f" of {self.gpu_memory_gib:g} GiB"
        cpus = "" if self.cpus_per_node is None else f", {self.cpus_per_node} CPUs each"
        lines = [f"placement plan (cluster={self.launcher}): {_n(len(self.facts.nodes), 'node')}{gpus}{cpus}; "
                 f"nodes from {self.facts.source}",
                 f"model {self.model}: {_count(self.total_params)} parameters ({_count(self.routed_params)} in "
                 f"routed experts)"]
        per_node = {node: [r for r in self.ranks if r.node == node] for node in self.training_nodes}
        layout = self.layout.text() if self.layout else "layout refused (below)"
        gpu_text = f", {self.rank_gpus:g} GPU each" if self.rank_gpus else ""
        lines.append(f"training pool: {_nodes(self.training_nodes)}: {_n(self.world, 'learner rank')}{gpu_text}, "
                     f"Megatron {layout}")
        for node, ranks in per_node.items():
            lines.append(f"  {node}: " + (" ".join(r.label() if self.layout else f"r{r.rank}" for r in ranks)
                                          or "no learner rank"))
        unplaced = [r.rank for r in self.ranks if r.node is None]
        if unplaced:
            lines.append(f"  no node for rank(s) {_span(unplaced)}")
        if self.rank_memory:
            lines.append(f"  memory per rank: {self.rank_memory.line()}")
            lines.append(f"    ({self.rank_memory.details})")
        tps = sorted({e.tensor_parallel for e in self.engines})
        pps = sorted({e.pipeline_parallel for e in self.engines})
        eps = sorted({e.tensor_parallel for e in self.engines if e.expert_parallel})
        expert = (f" EP={','.join(map(str, eps))} (routed experts sharded whole over the TP workers)" if eps else "")
        lines.append(f"inference pool: {_nodes(self.inference_nodes)}: {_n(len(self.engines), 'engine')} x TP="
                     f"{','.join(map(str, tps))}" + (f" PP={','.join(map(str, pps))}" if pps != [1] else "") + expert
                     + (f", {_n(self.engines[0].gpus, 'GPU')} each" if self.engines and self.engines[0].gpus else "")
                     + (f", stages across {_n(len(self.engines[0].nodes), 'node')} each (vLLM's Ray executor, one "
                        "bundle per worker)" if self.engines and self.engines[0].spans_nodes else ""))
        for node in self.inference_nodes:
            names = [e.name + _stages_on(e, node) for e in self.engines if node in e.nodes]
            used = sum(e.gpus if not e.spans_nodes else e.worker_nodes.count(node) for e in self.engines
                       if node in e.nodes)
            room = f" ({used:g} of {self.gpus_per_node} GPUs)" if self.gpus_per_node and used else ""
            lines.append(f"  {node}: {', '.join(names) or 'no engine'}{room}")
        unplaced_engines = [e.name for e in self.engines if e.node is None]
        if unplaced_engines:
            lines.append(f"  no node for {', '.join(unplaced_engines)}")
        if self.engine_memory:
            lines.append(f"  memory per engine GPU: {self.engine_memory.line()}")
        lines.append(self._sync_line())
        if self.checkpoint is not None:
            lines.append(self.checkpoint.line())
        if self.unused_nodes:
            lines.append(f"unused nodes: {' '.join(self.unused_nodes)}")
        lines += [f"note: {note}" for note in self.notes]
        if self.ok:
            lines.append("plan: OK")
        else:
            lines.append(f"plan: REFUSED ({len(self.problems)} reason{'s' if len(self.problems) > 1 else ''})")
            lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def _sync_line(self) -> str:
        size = _bytes(self.sync_bytes if self.adapter_bytes is None else self.adapter_bytes)
        what = (f"weight sync: {size} per version ({_count(self.total_params)} parameters x "
                f"{DTYPE_BYTES[self.sync_dtype]} bytes, {self.sync_dtype})" if self.adapter_bytes is None else
                f"weight sync: {_bytes(self.sync_bytes)} for the first version ({_count(self.total_params)} "
                f"parameters and the adapters x {DTYPE_BYTES[self.sync_dtype]} bytes, {self.sync_dtype}), then {size} "
                "per version (the LoRA adapters only)")
        learner_hosts = set(self.training_nodes)
        hosts = self.engine_hosts
        if not self.pinned and self.facts.source.startswith("cluster.ray_address"):
            # The joined cluster's nodes are not known here: a two-host run printed "shared memory on the learner's
            # host" and then relayed every version (tools/two_node_run.py)
            return (f"{what} through shared memory where an engine shares a host with the learner ranks, relayed to "
                    "the others (Ray places the pools: the 'weight relay' line once they are up names the hosts)")
        if not self.pinned:
            return f"{what} through shared memory on the learner's host"
        remote = [h for h in hosts if h not in learner_hosts]
        per_host = ", ".join(f"{h} {size}" + ("" if h in remote else " (shared memory: learner ranks run there)")
                             for h in hosts) or "no engine host"
        network = (f"{_bytes((self.adapter_bytes or self.sync_bytes) * len(remote))} per version over the network to "
                   f"{_n(len(remote), 'host')} without a learner rank" if remote else "nothing over the network")
        return f"{what} into each engine host: {per_host}; {network}"

    def refusal(self) -> str:
        return "the placement plan is refused: " + "; ".join(self.problems)


def _stages_on(engine: EnginePlacement, node: str) -> str:
    """' stages 2-3' where an engine spanning nodes has those stages on `node`; '' for an engine on one node."""
    if not engine.spans_nodes:
        return ""
    stages = sorted({w // engine.tensor_parallel for w, n in enumerate(engine.worker_nodes) if n == node})
    return f" stage{'s' if len(stages) > 1 else ''} {_span(stages)}"


def _nodes(nodes: Sequence[str]) -> str:
    return f"{_n(len(nodes), 'node')} ({' '.join(nodes)})" if nodes else "no node"


def _n(count: float, word: str) -> str:
    return f"{count:g} {word}{'' if count == 1 else 's'}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _span(values: list[int]) -> str:
    return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def build_plan(run: RunConfig, environ: Mapping[str, str] | None = None, *, seq_len: int | None = None,
               run_command: RunCommand | None = run_command_stdout, write_gbps: float | None = None,
               measure_write: Callable[[str], float] | None = measure_write_gbps,
               checkpoint_dir: str | None = None) -> Plan:
    """The plan for `run` (a RunConfig) in `environ` (default os.environ). `seq_len`: positions per sequence the
    learner trains on (the engines' context once the prompts were read); None = `rollout.max_model_len` when set,
    else `rollout.max_tokens` alone, said in a note. `run_command` runs `scontrol show hostnames` (None: the Python
    expander only). A slurm plan whose environment gives `--signal`'s warning time (MOE_GRPO_SIGNAL_S) measures the
    write rate with `measure_write` in `checkpoint_dir` (default: the run directory under Hydra, else the current
    directory) unless `write_gbps` gives it."""
    environ = os.environ if environ is None else environ
    c = run.cluster
    problems: list[str] = []
    notes: list[str] = []
    facts = _facts(c, environ, run_command, problems)
    gpus = c.gpus_per_node if c.gpus_per_node is not None else facts.gpus_per_node
    cpus = c.cpus_per_node if c.cpus_per_node is not None else facts.cpus_per_node
    engine_tp, engine_pp = c.engine_tensor_parallel, c.engine_pipeline_parallel
    pools = (_slurm_pools if c.launcher == "slurm" else _local_pools)(run, facts.nodes, gpus, cpus, problems, notes)
    world, engine_gpus, rank_gpus = pools.world, pools.engine_gpus, pools.rank_gpus
    layout = _layout(run, world, problems) if world else None  # no training pool: a problem says so already
    gloo_problem = gloo_dispatcher_problem(run.parallel.tensor_parallel, run.parallel.expert_parallel,
                                           run.megatron.token_dispatcher)
    if layout is not None and gloo_problem and not rank_gpus:  # ranks without a GPU train over gloo
        problems.append(gloo_problem)
    spec = run.model
    problems += _engine_problems(run, gpus, cpus, notes)
    counts = param_counts(spec)
    gpu_bytes = c.gpu_memory_gib * GIB
    rank_mem = None
    if layout is not None and rank_gpus >= 1:
        rank_mem = rank_memory(spec, counts, layout.tp, layout.pp, layout.ep, layout.dp,
                               _training_shape(run, layout, seq_len, notes), gpu_bytes)
        if not rank_mem.fits:
            problems.append(_memory_refusal(run, counts.total, rank_mem, layout))
    elif 0 < rank_gpus < 1:
        notes.append(f"learner ranks share GPUs (cluster.learner_gpus={rank_gpus:g}): memory not checked")
    eng_mem = None
    if engine_gpus >= 1:
        # Expert parallelism (cluster.engine_expert_parallel) moves whole experts where TP slices them: the same
        # 1/TP of the routed experts per GPU, so the estimate does not depend on it (memory_estimate.engine_memory).
        eng_mem = engine_memory(counts.total, run.rollout.dtype, engine_tp, gpu_bytes, engine_pp)
        if not eng_mem.fits:
            need = math.ceil(counts.total * DTYPE_BYTES[run.rollout.dtype] / (engine_tp * eng_mem.capacity))
            helps = (f"more pipeline stages (cluster.engine_pipeline_parallel >= {need} at TP={engine_tp}: stages "
                     "beyond a node span nodes through vLLM's Ray executor, whole stages per node) or larger GPUs "
                     "(cluster.gpu_memory_gib)" if gpus else
                     "more GPUs per engine (cluster.engine_tensor_parallel x cluster.engine_pipeline_parallel) or "
                     "larger GPUs (cluster.gpu_memory_gib)")
            problems.append(
                f"an engine GPU needs {eng_mem.weights / GIB:.1f} GiB for its share of the weights "
                f"({counts.total / 1e9:.2f}B parameters x {DTYPE_BYTES[run.rollout.dtype]} bytes {run.rollout.dtype} / "
                f"TP {engine_tp}{f' x PP {engine_pp}' if engine_pp > 1 else ''}) but vLLM may use "
                f"{eng_mem.capacity / GIB:.1f} GiB of a {c.gpu_memory_gib:g}-GiB GPU (0.9 of it less {RESERVED_GIB:g} GiB); {helps}")
    ranks = []
    for r in range(world):
        tp, pp, dp, ep, edp = coordinates(r, layout) if layout else (0, 0, 0, 0, 0)
        ranks.append(RankPlacement(r, pools.rank_nodes[r], tp, pp, dp, ep, edp))
    engines = tuple(EnginePlacement(f"engine{i}", pools.engine_nodes[i], engine_tp, engine_gpus, c.engine_cpus,
                                    engine_pp, c.engine_expert_parallel,
                                    pools.engine_worker_nodes[i] if pools.engine_worker_nodes else ())
                    for i in range(c.num_engines))
    sync_dtype = version_dtype(run.rollout.dtype, run.lora)
    sync_bytes, adapter_bytes = version_bytes(run, spec, counts.total, sync_dtype)
    checkpoint = None
    if c.launcher == "slurm":
        checkpoint = _checkpoint_time(run, counts.total, environ, write_gbps, measure_write, checkpoint_dir, notes)
        if checkpoint.warning():
            notes.append(f"WARNING: {checkpoint.warning()}")
    return Plan(launcher=c.launcher, facts=facts, gpus_per_node=gpus, cpus_per_node=cpus,
                gpu_memory_gib=c.gpu_memory_gib, model=spec.name, total_params=counts.total,
                routed_params=counts.routed, training_nodes=pools.training, inference_nodes=pools.inference,
                unused_nodes=pools.unused, engines=engines, ranks=tuple(ranks), world=world, layout=layout,
                rank_gpus=rank_gpus, sync_dtype=sync_dtype, sync_bytes=sync_bytes, adapter_bytes=adapter_bytes,
                rank_memory=rank_mem, engine_memory=eng_mem, problems=tuple(problems), notes=tuple(notes),
                checkpoint=checkpoint)


def _engine_problems(run: RunConfig, gpus: int | None, cpus: int | None, notes: list[str]) -> list[str]:
    """What an engine's shape asks that vLLM cannot build here: a TP not dividing the heads, more stages than layers,
    served LoRA adapters with stages, expert parallelism where the engines run on CPU. Notes an engine on CPU with
    more vLLM workers than the node has cores (each worker gets a core set; they then share cores)."""
    c, spec, problems = run.cluster, run.model, []
    engine_tp, engine_pp = c.engine_tensor_parallel, c.engine_pipeline_parallel
    if not gpus and cpus and engine_tp * engine_pp > cpus:
        notes.append(f"an engine of TP={engine_tp} x PP={engine_pp} runs {engine_tp * engine_pp} vLLM workers, one "
                     f"core set each, on nodes of {cpus} CPUs: its workers share cores (it runs, slower; "
                     f"cluster.engine_cpus={c.engine_cpus:g} is what the plan reserves for it)")
    if spec.num_attention_heads % engine_tp:
        problems.append(f"cluster.engine_tensor_parallel={engine_tp} does not divide the model's "
                        f"{spec.num_attention_heads} attention heads (vLLM splits heads over its TP ranks)")
    if engine_pp > spec.num_layers:
        problems.append(f"cluster.engine_pipeline_parallel={engine_pp} stages for the model's {spec.num_layers} "
                        "decoder layers (vLLM gives each stage at least one layer)")
    if c.engine_expert_parallel and not gpus and (gpus == 0 or cpu_build_installed()):
        problems.append(f"cluster.engine_expert_parallel=true where the engines run on CPU (nodes without GPUs, or "
                        f"vLLM's CPU build installed): {CPU_EXPERT_PARALLEL_SEGFAULT}; set cluster.engine_expert_parallel=false "
                        "(the experts are then tensor-sliced over the engine's workers) or run it on GPUs")
    if engine_pp > 1 and run.lora.enabled and run.sync.lora_apply == "serve":
        problems.append(f"cluster.engine_pipeline_parallel={engine_pp} with sync.lora_apply=serve: adapters served by "
                        "vLLM are built for engines of one pipeline stage; set sync.lora_apply=merge (each stage "
                        "merges its own layers)")
    return problems


def version_bytes(run: RunConfig, spec: MoEModelSpec, params: int, dtype: str) -> tuple[int, int | None]:
    """(bytes of a run's first version, of each version after it with LoRA (the adapters only; None without))."""
    if not run.lora.enabled:
        return params * DTYPE_BYTES[dtype], None
    adapters = sum(math.prod(shape) for shape in peft_shapes(spec, run.lora).values())
    return (params + adapters) * DTYPE_BYTES[dtype], adapters * DTYPE_BYTES[dtype]


def _checkpoint_time(run: RunConfig, total_params: int, environ: Mapping[str, str], write_gbps: float | None,
                     measure_write: Callable[[str], float] | None, directory: str | None,
                     notes: list[str]) -> CheckpointTime:
    signal_s = signal_warning_s(environ, notes)
    where = None
    if write_gbps is None and signal_s is not None and measure_write is not None:
        where = directory or _run_dir(run)
        try:
            write_gbps = measure_write(where)
        except OSError as e:
            notes.append(f"the checkpoint write rate could not be measured in {where}: {e}")
    weights, optimizer = checkpoint_bytes(total_params, run.megatron.params_dtype)
    return CheckpointTime(weights, optimizer, write_gbps, where, signal_s)


def _run_dir(run: RunConfig) -> str:
    """Where the run's checkpoints go: Hydra's run directory (its nearest existing ancestor), else the current
    directory (a dry run's Hydra directory is a temporary one)."""
    path = os.getcwd()
    if not run.cluster.dry_run:
        try:
            from hydra.core.hydra_config import HydraConfig

            if HydraConfig.initialized():
                path = os.path.abspath(HydraConfig.get().runtime.output_dir)
        except (ImportError, ValueError):
            pass
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


@dataclass(frozen=True)
class _Pools:
    """Where each pool's actors go and what each holds."""

    training: tuple[str, ...]
    inference: tuple[str, ...]
    unused: tuple[str, ...]
    engine_nodes: list[str | None]
    rank_nodes: list[str | None]
    world: int
    engine_gpus: float
    rank_gpus: float
    engine_worker_nodes: list[tuple[str, ...]] = field(default_factory=list)
    """Per engine, its workers' nodes when its stages span nodes (else empty)."""


def _slurm_pools(run: RunConfig, nodes: tuple[str, ...], gpus: int | None, cpus: int | None, problems: list[str],
                 notes: list[str]) -> _Pools:
    """The job's nodes split between the pools (training first), each actor on a node with room for it."""
    c = run.cluster
    engine_tp, engine_pp = c.engine_tensor_parallel, c.engine_pipeline_parallel
    engine_workers = engine_tp * engine_pp  # one GPU per vLLM worker, every stage on the engine's node
    use_gpus = bool(gpus)
    engine_gpus = float(engine_workers) if use_gpus else 0.0
    rank_gpus = 1.0 if use_gpus else 0.0
    if use_gpus and c.engine_gpus not in (0, engine_gpus):
        problems.append(f"cluster.engine_gpus={c.engine_gpus:g} but an engine of cluster.engine_tensor_parallel="
                        f"{engine_tp}" + (f" x cluster.engine_pipeline_parallel={engine_pp}" if engine_pp > 1 else "")
                        + f" holds {engine_workers} GPU(s) (leave engine_gpus at 0 under cluster=slurm)")
    if use_gpus and c.learner_gpus not in (0, 1):
        problems.append(f"cluster.learner_gpus={c.learner_gpus:g} but under cluster=slurm each learner rank "
                        "holds one GPU (leave learner_gpus at 0)")
    if not use_gpus and (c.engine_gpus or c.learner_gpus):
        problems.append(f"cluster.engine_gpus={c.engine_gpus:g} / cluster.learner_gpus={c.learner_gpus:g} but the "
                        f"nodes have no GPUs (gpus_per_node={gpus}); set cluster.gpus_per_node if SLURM does not "
                        "say")
    span = None
    if use_gpus:
        span, why = engine_span(engine_tp, engine_pp, gpus)
        if why:
            problems.append(why)
    elif cpus and c.engine_cpus > cpus:
        problems.append(f"an engine of cluster.engine_cpus={c.engine_cpus:g} does not fit a node of {cpus} CPUs, and "
                        f"its pipeline stages cannot span nodes on CPU: {RAY_ON_CPU_REFUSAL}")
    spanning = span is not None and span.spans_nodes
    # An engine spanning nodes fills whole nodes (none shares them); its actor reserves no GPU of its own.
    engines_per_node = 1 if spanning else _per_node(engine_gpus, gpus, c.engine_cpus, cpus, c.num_engines)
    unit = "GPUs" if use_gpus else "CPUs"
    per_node = gpus if use_gpus else cpus
    need_engine = engine_gpus if use_gpus else c.engine_cpus
    if len(nodes) == 1 and c.inference_nodes is None and c.training_nodes is None:
        # A one-node job: both pools on it, the engines' GPUs (CPUs) first, the learner ranks on the rest.
        training = inference = tuple(nodes)
        unused: tuple[str, ...] = ()
        gpus_left = (gpus or 0) - c.num_engines * engine_gpus
        cpus_left = cpus - c.num_engines * c.engine_cpus if cpus else None
        ranks_per_node = _per_node(rank_gpus, max(0, int(gpus_left)), c.learner_cpus,
                                   max(0, int(cpus_left)) if cpus_left is not None else None, None)
        room = f"{nodes[0]}'s {per_node} {unit} less the engines' {c.num_engines * need_engine:g}"
        train_gpus = max(0, int(gpus_left)) if use_gpus else 0
    else:
        training, inference, unused = _split_nodes(c, nodes, engines_per_node, problems,
                                                   span.nodes if spanning else 1)
        ranks_per_node = _per_node(rank_gpus, gpus, c.learner_cpus, cpus, None)
        room = f"the training pool's {len(training)} node(s) x {per_node} {unit}"
        train_gpus = len(training) * (gpus or 0)
    world = c.learner_ranks or (train_gpus if use_gpus and train_gpus else run.parallel.world_size())
    worker_nodes: list[tuple[str, ...]] = [()] * c.num_engines
    if spanning:
        assert span is not None
        engine_nodes, worker_nodes = _fill_spanning(c.num_engines, inference, span)
    else:
        engine_nodes = _fill(c.num_engines, inference, engines_per_node)
    rank_nodes = _fill(world, training, ranks_per_node)
    if None in engine_nodes and inference:
        held = len(inference) // span.nodes if spanning and span else len(inference) * engines_per_node
        problems.append(f"{c.num_engines} engine(s) x {need_engine:g} {unit} need {c.num_engines * need_engine:g} "
                        f"{unit}; the inference pool ({len(inference)} node(s) x {per_node} {unit}) holds "
                        f"{held} engine(s)" + (f" of {span.nodes} whole nodes each" if spanning and span else ""))
    if None in rank_nodes and training:
        need = 1 if use_gpus else c.learner_cpus
        problems.append(f"{world} learner rank(s) x {need:g} {unit} need {world * need:g} {unit}; {room} have "
                        f"room for {len(training) * (ranks_per_node or 0)}")
    if use_gpus and training and world < train_gpus:
        problems.append(f"the learner world ({world} rank(s)) leaves {train_gpus - world} of the training pool's "
                        f"{train_gpus} GPUs idle; set cluster.learner_ranks={train_gpus} or fewer "
                        "cluster.training_nodes")
    if ranks_per_node and run.parallel.tensor_parallel > 1 and ranks_per_node % run.parallel.tensor_parallel:
        notes.append(f"TP={run.parallel.tensor_parallel} groups span nodes ({ranks_per_node} ranks per node): "
                     "their all-reduces cross the network")
    return _Pools(tuple(training), tuple(inference), tuple(unused), engine_nodes, rank_nodes, world, engine_gpus,
                  rank_gpus, worker_nodes)


def _fill_spanning(count: int, nodes: Sequence[str], span: EngineSpan) -> tuple[list[str | None],
                                                                                 list[tuple[str, ...]]]:
    """Engine i on nodes [i x span.nodes, (i + 1) x span.nodes) (None past the pool's room): its actor's node
    (stage 0's) and each worker's node."""
    actor_nodes: list[str | None] = []
    workers: list[tuple[str, ...]] = []
    for i in range(count):
        mine = list(nodes[i * span.nodes:(i + 1) * span.nodes])
        if len(mine) < span.nodes:
            actor_nodes.append(None)
            workers.append(())
        else:
            actor_nodes.append(mine[0])
            workers.append(tuple(span.worker_nodes(mine)))
    return actor_nodes, workers


def _local_pools(run: RunConfig, nodes: tuple[str, ...], gpus: int | None, cpus: int | None, problems: list[str],
                 notes: list[str]) -> _Pools:
    """Both pools on this host (or the joined cluster, where Ray places them), GPUs as `cluster.*_gpus` reserve."""
    c = run.cluster
    world = run.learner_world_size()
    engine_gpus, rank_gpus = float(c.engine_gpus), float(c.learner_gpus)
    host = nodes[0]
    training, inference, unused = (host,), (host,), ()
    engine_nodes, rank_nodes = [host] * c.num_engines, [host] * world
    need = c.num_engines * engine_gpus + world * rank_gpus
    if need and gpus is not None and need > gpus:
        problems.append(f"{c.num_engines} engine(s) x {engine_gpus:g} GPU + {world} learner rank(s) x "
                        f"{rank_gpus:g} GPU need {need:g} GPUs; {host} has {gpus}")
    elif need and gpus is None and not c.ray_address:
        notes.append(f"the pools reserve {need:g} GPUs; this host's GPU count is unknown (not checked)")
    cpus_needed = c.num_engines * c.engine_cpus + world * c.learner_cpus
    if not c.ray_address and cpus and cpus_needed > cpus:
        # The run's own Ray cluster gets this host's CPUs; a placement group asking for more waits, silently,
        # until cluster.start_timeout_s.
        problems.append(f"{c.num_engines} engine(s) x cluster.engine_cpus={c.engine_cpus:g} + {world} learner "
                        f"rank(s) x cluster.learner_cpus={c.learner_cpus:g} reserve {cpus_needed:g} CPUs; {host} has "
                        f"{cpus}: lower them (a fraction shares a core) or join a larger Ray cluster "
                        f"(cluster.ray_address)")
    return _Pools(training, inference, unused, engine_nodes, rank_nodes, world, engine_gpus, rank_gpus)


def _facts(c: ClusterConfig, environ: Mapping[str, str], run_command: RunCommand | None, problems: list[str]) -> NodeFacts:
    if c.launcher == "local":
        if c.ray_address:
            return NodeFacts((f"<the Ray cluster at {c.ray_address}>",), None, None,
                             f"cluster.ray_address={c.ray_address} (Ray places the pools)")
        return local_facts(environ)
    facts = slurm_facts(environ, run_command)
    if c.nodes:
        return NodeFacts(tuple(c.nodes), facts.gpus_per_node if facts else None,
                         facts.cpus_per_node if facts else None, "cluster.nodes", facts.problems if facts else ())
    if facts is None:
        problems.append("cluster=slurm but SLURM_JOB_NODELIST is not set (not inside a SLURM job?); run it from an "
                        "sbatch/salloc allocation or name the hosts with cluster.nodes=[host1,host2]")
        return NodeFacts((), None, None, "nowhere (no SLURM_JOB_NODELIST)")
    problems.extend(facts.problems)
    return facts


def _per_node(gpus_each: float, gpus: int | None, cpus_each: float, cpus: int | None, unknown: int | None) -> int:
    """How many actors fit one node: by GPUs when they hold any, and by CPUs when the count is known."""
    fits = []
    if gpus_each:
        fits.append(int((gpus or 0) // gpus_each))
    if cpus_each and cpus:
        fits.append(int(cpus // cpus_each))
    if not fits:
        return unknown if unknown is not None else 1 << 30
    return min(fits)


def _split_nodes(c: ClusterConfig, nodes: Sequence[str], engines_per_node: int, problems: list[str],
                 nodes_per_engine: int = 1) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(training, inference, unused) nodes: the training pool first (rank 0 next to the driver on the first node).
    `nodes_per_engine` > 1: engines whose stages span that many whole nodes."""
    n = len(nodes)
    if not n:
        return (), (), ()
    if c.inference_nodes is not None:
        inference = c.inference_nodes
    elif c.training_nodes is not None:
        inference = n - c.training_nodes
    elif nodes_per_engine > 1:
        inference = c.num_engines * nodes_per_engine
    else:
        inference = math.ceil(c.num_engines / engines_per_node) if engines_per_node else 1
    training = c.training_nodes if c.training_nodes is not None else n - inference
    if inference + training > n:
        problems.append(f"the pools want {training} training + {inference} inference node(s) but the job has {n}: "
                        f"{' '.join(nodes)} (cluster.training_nodes / cluster.inference_nodes, or more nodes)")
    if training < 1:
        problems.append(f"no node left for the training pool: {n} node(s), {inference} of them for "
                        f"{c.num_engines} engine(s); set cluster.inference_nodes / cluster.training_nodes")
    if inference < 1:
        problems.append(f"no node left for the inference pool ({n} node(s), cluster.training_nodes={training})")
    training = max(0, min(training, n))
    inference = max(0, min(inference, n - training))
    return tuple(nodes[:training]), tuple(nodes[training:training + inference]), tuple(nodes[training + inference:])


def _fill(count: int, nodes: Sequence[str], per_node: int) -> list[str | None]:
    """Actor i on node i // per_node; None past the pool's room."""
    return [nodes[i // per_node] if per_node and i // per_node < len(nodes) else None for i in range(count)]


def _layout(run: RunConfig, world: int, problems: list[str]) -> Layout | None:
    """Megatron's split of `world` (parallel_state.initialize_model_parallel's rules, and the model's), or None."""
    p, spec = run.parallel, run.model
    tp, pp, ep = p.tensor_parallel, p.pipeline_parallel, p.expert_parallel
    before = len(problems)
    if world % (tp * pp):
        problems.append(f"Megatron needs the learner world ({world} rank(s)) to be a multiple of TP x PP = "
                        f"{tp} x {pp} = {tp * pp} (world = TP x PP x DP)")
    elif (world // (tp * pp)) % ep:
        problems.append(f"Megatron needs TP x EP x PP = {tp} x {ep} x {pp} = {tp * ep * pp} to divide the learner "
                        f"world ({world} rank(s)): EP={ep} does not divide DP={world // (tp * pp)}")
    if spec.num_experts % ep:
        problems.append(f"parallel.expert_parallel={ep} does not divide the model's {spec.num_experts} experts "
                        f"({spec.name})")
    if spec.num_layers % pp:
        problems.append(f"parallel.pipeline_parallel={pp} does not divide the model's {spec.num_layers} layers "
                        f"({spec.name}; stages hold equal numbers of layers)")
    if spec.num_attention_heads % tp or (not spec.uses_mla and spec.query_groups % tp):
        problems.append(f"parallel.tensor_parallel={tp} does not divide the model's {spec.num_attention_heads} "
                        f"attention heads / {spec.query_groups} key-value groups")
    if len(problems) > before:
        return None
    return Layout(world, tp, pp, world // (tp * pp), ep)


def _training_shape(run: RunConfig, layout: Layout, seq_len: int | None, notes: list[str]) -> TrainingShape:
    learner, rollout = run.learner, run.rollout
    if learner.packed and learner.packed_seq_len:
        positions = learner.packed_seq_len
    elif seq_len:
        positions = seq_len
    elif rollout.max_model_len:
        positions = rollout.max_model_len
    else:
        positions = rollout.max_tokens
        notes.append(f"activations sized for rollout.max_tokens={positions} positions only (prompts not read); set "
                     "rollout.max_model_len for the full context")
    if learner.packed:
        rows = 1
    else:  # a data-parallel rank's share of a step's sequences, micro_batch_size at most
        rows = min(learner.micro_batch_size, math.ceil(run.algo.prompts_per_step * run.algo.group_size / layout.dp))
    m = run.megatron
    return TrainingShape(params_dtype=m.params_dtype, grad_reduce_in_fp32=m.grad_reduce_in_fp32,
                         distributed_optimizer=m.distributed_optimizer, recompute=m.recompute,
                         kl_reference=run.algo.kl_coef > 0, micro_batch=rows, seq_len=positions,
                         probe=run.routing.probe_prompts > 0 and run.routing.probe_every > 0,
                         cuda_ipc_slots=run.sync.slots if run.sync.transport == "cuda_ipc" else 0,
                         sync_dtype=version_dtype(run.rollout.dtype, run.lora))


def _memory_refusal(run: RunConfig, total: int, mem: RankMemory, layout: Layout) -> str:
    wbytes = DTYPE_BYTES[run.megatron.params_dtype]
    state = total * (wbytes + (4 if run.megatron.grad_reduce_in_fp32 or wbytes == 4 else wbytes)
                     + (8 if wbytes == 4 else 12))
    least = math.ceil(state / mem.capacity)
    helps = ["more training nodes (cluster.training_nodes)"]
    if not run.megatron.distributed_optimizer:
        helps.append("megatron.distributed_optimizer=true")
    if not run.megatron.recompute:
        helps.append("megatron.recompute=true")
    if run.learner.micro_batch_size > 1:
        helps.append("a smaller learner.micro_batch_size")
    if mem.probe:
        helps.append(f"routing.probe_prompts=0 (no mismatch probe: {mem.probe / GIB:.1f} GiB less)")
    if mem.sync_slots:
        helps.append(f"sync.transport=shm (weights through host memory: {mem.sync_slots / GIB:.1f} GiB less on rank 0)")
    helps[-1] = ("or " if len(helps) > 1 else "") + helps[-1]
    return (f"a learner rank needs {mem.total / GIB:.1f} GiB ({mem.terms()} on pipeline stage {mem.stage}) but a GPU "
            f"has {mem.capacity / GIB:.1f} GiB usable (cluster.gpu_memory_gib={run.cluster.gpu_memory_gib:g} less "
            f"{RESERVED_GIB:g} GiB); the model's weights, gradients and Adam state alone are "
            f"{state / 2**40:.2f} TiB, at least {least} such GPUs even perfectly sharded (the training pool has "
            f"{layout.world})" + (f"; {', '.join(helps)}" if helps else ""))


def not_runnable_yet(plan: Plan) -> list[str]:
    """What a valid plan asks that this build cannot run yet (the driver refuses these at start; a dry run only
    notes them)."""
    out: list[str] = []
    # Engines with tensor parallelism run (VllmEngine(tensor_parallel=N), one vLLM worker per GPU, or per core set
    # on CPU), and with pipeline stages on the engine's node (VllmEngine(pipeline_parallel=N)). Engines on hosts without a learner rank get each version through `sync.transport` (relay under `auto`;
    # sync_hosts.plan_sync refuses shm / cuda_ipc across hosts once Ray placed the bundles).
    return out


def pin_bundles(bundles: list[dict[str, float]], bundle_nodes: Sequence[str | None],
                ray_nodes: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Each bundle with a sliver of its node's `node:<ip>` resource, so Ray reserves it on the node the plan names.

    `ray_nodes`: `ray.nodes()` (alive ones are used); a plan's host name matches a Ray node's NodeManagerHostname,
    whole or up to its first dot (SLURM's short names). Raises RuntimeError naming a node that has not joined."""
    by_name: dict[str, str] = {}
    for node in ray_nodes:
        if not node.get("Alive", True):
            continue
        hostname, address = str(node.get("NodeManagerHostname", "")), str(node.get("NodeManagerAddress", ""))
        for name in (hostname, hostname.split(".")[0]):
            by_name.setdefault(name, address)
    pinned = []
    for bundle, name in zip(bundles, bundle_nodes):
        if name is None:
            pinned.append(dict(bundle))
            continue
        address = by_name.get(name) or by_name.get(name.split(".")[0])
        if not address:
            raise RuntimeError(f"the plan places work on {name}, which has not joined the Ray cluster (joined: "
                               f"{', '.join(sorted(n for n in by_name if '.' not in n)) or 'none'}); start a Ray "
                               "worker there (examples/slurm/train.sbatch does)")
        pinned.append({**bundle, f"node:{address}": 0.001})
    return pinned


def dry_run(run: RunConfig) -> int:
    """`cluster.dry_run=true`: print the placement plan (the prompts are read for the context length, nothing is
    started) and return the exit status: 0 when it fits, 2 with the reasons when it is refused."""
    seq_len = run.rollout.max_model_len
    if not seq_len:
        try:
            source = prompt_source(run, load_tokenizer(run.model, run.init.hf), np.random.default_rng(run.seed))
            seq_len = engine_context(run, source)
        except ValueError as e:  # a prompt that does not fit the model: what the run would stop on too
            print(f"[moe_grpo] config error: {e}", file=sys.stderr)
            return 2
    plan = build_plan(run, seq_len=seq_len)
    print(plan.render())
    for limit in not_runnable_yet(plan):
        print(f"note: a run of this plan stops at start in this build: {limit}")
    if not plan.ok:
        print(f"[moe_grpo] {plan.refusal()}", file=sys.stderr)
        return 2
    return 0
