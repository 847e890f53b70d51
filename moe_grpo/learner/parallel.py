"""How the learner is split across processes: TP (with SP), EP, PP and the DP that remains.

This is the one place that decides parallelism (torchtitan keeps it in
`parallelize.py`); model code receives only the sizes chosen here.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_grpo.validate import at_least


@dataclass(frozen=True)
class ParallelLayout:
    """Process layout of one learner."""

    tensor_parallel: int = 1
    """TP size. MoE with TP > 1 always runs with sequence parallel."""
    expert_parallel: int = 1
    """EP size; carved out of the data-parallel ranks, as in Megatron."""
    pipeline_parallel: int = 1
    """PP size; layers are split evenly across stages."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel"):
            at_least(f"parallel.{name}", getattr(self, name), 1)

    @property
    def sequence_parallel(self) -> bool:
        return self.tensor_parallel > 1

    def data_parallel(self, world_size: int) -> int:
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_parallel*pipeline_parallel={model_parallel}"
            )
        dp = world_size // model_parallel
        if dp % self.expert_parallel:
            raise ValueError(
                f"expert_parallel={self.expert_parallel} must divide the data-parallel size {dp} "
                f"(world {world_size} / TP {self.tensor_parallel} / PP {self.pipeline_parallel})"
            )
        return dp

    def world_size(self) -> int:
        """Smallest world that holds this layout (DP = EP)."""
        return self.tensor_parallel * self.pipeline_parallel * self.expert_parallel

    def megatron_kwargs(self, num_layers: int, num_experts: int, dtype: Any = None) -> dict[str, Any]:
        """TransformerConfig fields for this layout (validated against the model).

        `dtype` is the model's parameter dtype; activations travel between pipeline
        stages in it (fp32 when None)."""
        import torch

        if num_experts % self.expert_parallel:
            raise ValueError(f"expert_parallel={self.expert_parallel} must divide num_experts={num_experts}")
        if num_layers % self.pipeline_parallel:
            raise ValueError(f"pipeline_parallel={self.pipeline_parallel} must divide num_layers={num_layers}")
        return dict(
            tensor_model_parallel_size=self.tensor_parallel,
            expert_model_parallel_size=self.expert_parallel,
            pipeline_model_parallel_size=self.pipeline_parallel,
            sequence_parallel=self.sequence_parallel,
            pipeline_dtype=(dtype or torch.float32) if self.pipeline_parallel > 1 else None,
        )


SECRET_ENV = "MOE_GRPO_STORE_SECRET"
"""The run's rendezvous secret (learner_actor.LearnerWorker and spawn.run_distributed set it in each rank's own
environment, which only its user can read)."""

_store_server: Any = None
"""Rank 0's `RunStoreServer`, kept for the life of the process group."""
_store_client: Any = None
"""This rank's `RunStore`, kept alive here: torch holds only the C++ half of a Python store, and its Python methods
vanish with the last Python reference (new_group then fails with "Not implemented")."""


_groups_world: Any = None
"""The default process group megatron-core's groups were last made from (init_distributed)."""


def init_distributed(layout: ParallelLayout, *, timeout_s: float = 300.0) -> None:
    """Start torch.distributed (gloo on CPU, NCCL on GPU) and Megatron's model-parallel groups.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and the run's secret (`MOE_GRPO_STORE_SECRET`) from the
    environment (Ray actors and our test launcher set them). Rank 0 serves the rendezvous store on
    MASTER_ADDR:MASTER_PORT and only processes holding the secret get in (learner/rendezvous.py); under torchrun,
    without a secret, torchrun's own store is used. Applies the megatron-core CPU patches first when CUDA is absent,
    and the shard-digest patch (megatron_write_digests) everywhere.
    """
    import torch

    from moe_grpo.learner import megatron_cpu, megatron_write_digests

    global _groups_world
    megatron_cpu.apply()
    megatron_write_digests.apply()
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size > 1:
            if "MASTER_PORT" not in os.environ:
                raise RuntimeError("WORLD_SIZE > 1 but MASTER_PORT is not set; launch with torchrun or set it")
            if backend == "nccl":
                local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
                torch.cuda.set_device(local % torch.cuda.device_count())
            secret = os.environ.get(SECRET_ENV)
            if os.environ.get("MASTER_ADDR") == "127.0.0.1":
                # A single-host group: gloo's own pair sockets listen on loopback too (not the hostname's address).
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            if secret:
                dist.init_process_group(backend, store=_run_store(secret, timeout), rank=int(os.environ["RANK"]),
                                        world_size=world_size, timeout=timeout)
            elif "TORCHELASTIC_RUN_ID" in os.environ:
                dist.init_process_group(backend, timeout=timeout)  # torchrun's rendezvous
            else:
                raise RuntimeError(f"WORLD_SIZE={world_size} but {SECRET_ENV} is not set: the rendezvous store "
                                   "admits only holders of the run's secret (launch with torchrun, or set it)")
        else:
            # One process: an in-process store, no port at all.
            if backend == "nccl":
                torch.cuda.set_device(0)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    layout.data_parallel(world)  # validates
    if parallel_state.model_parallel_is_initialized():
        same = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size()) == \
            (layout.tensor_parallel, layout.pipeline_parallel, layout.expert_parallel)
        if same and _groups_world is dist.distributed_c10d._get_default_group():
            # Keep the groups: megatron-core's destroy_model_parallel drops its references to most groups without
            # destroying them, so every re-initialisation in a process left ~20 gloo groups alive, each with a
            # TCP loop thread waking constantly (a test process that built ~50 learners spent most of two cores
            # switching between 1,100 such threads).
            # Only while the default group they were made from lives (a test may have torn it down and made another).
            return
        parallel_state.destroy_model_parallel()
    _groups_world = dist.distributed_c10d._get_default_group()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        expert_model_parallel_size=layout.expert_parallel,
    )


def _run_store(secret: str, timeout: datetime.timedelta) -> Any:
    """This rank's client of the run's store; rank 0 serves it first, on MASTER_ADDR only (not every interface)."""
    global _store_server, _store_client
    from moe_grpo.learner.rendezvous import RunStore, RunStoreServer

    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    if int(os.environ["RANK"]) == 0:
        if _store_server is not None:
            _store_server.close()
        _store_server = RunStoreServer(host, port, secret)
    _store_client = RunStore(host, port, secret, timeout)
    return _store_client


def seed_everything(seed: int) -> None:
    """Same seed on every rank; Megatron's tracker gives TP/EP ranks their own streams."""
    import torch
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def gather_by_index(indices: list[int], values: list[Any]) -> dict[int, Any]:
    """Collective: every rank's (index, value) pairs, merged into one dict on every rank.

    For results computed on each data-parallel rank's share of a batch (TP/PP
    peers hold the same pairs; merging them is harmless).
    """
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (list(indices), list(values)))
    merged: dict[int, Any] = {}
    for idx, vals in parts:
        merged.update(zip(idx, vals))
    return merged


def ranks() -> dict[str, int]:
    """This process's coordinates in every Megatron group."""
    from megatron.core import parallel_state as ps

    return dict(
        tp=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        dp=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )
