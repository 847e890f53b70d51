"""A learner's checkpoints on disk: weights alone (`save_weights` / `load_weights`) and the whole run state
(`save_run_state` / `load_run_state`: weights, optimizer state, the KL reference, RNG states and a meta file).

Both go through Megatron's distributed checkpoint, sharded per model tensor, so a checkpoint saved at one TP/EP/PP
layout loads at any other. Every function here is a collective: all ranks of the layout call it together. The
files are checked (`checkpoint_files`) before anything changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from moe_grpo.learner import megatron_sync_save, megatron_write_digests
from moe_grpo.learner.checkpoint_files import (RUN_STATE_DIST, RUN_STATE_FORMAT, RUN_STATE_META,
                                               IncompleteCheckpointError, check_dist_checkpoint_files, check_file,
                                               on_every_rank, read_run_state_meta, why)
from moe_grpo.learner.optimizer import (adam_step, load_optimizer_state, optimizer_sharded_state_dict,
                                        reset_optimizer_state)
from moe_grpo.learner.parallel import ParallelLayout
from moe_grpo.learner.rng_state import RNG_FILE_RE, capture_rng_state, rng_file
from moe_grpo.models.spec import SPEC_FILE, MoEModelSpec, read_spec, write_spec


def write_dist(sharded: Any, directory: str, spec: MoEModelSpec) -> None:
    """Collective: write `sharded` as a Megatron distributed checkpoint into a new, empty `directory`, plus the
    model's description (the checkpoint describes its model: export needs no config)."""
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
    torch.distributed.barrier()
    with megatron_sync_save.in_process_results():  # no spawned Manager process for a synchronous save
        dist_checkpointing.save(sharded, directory)
    torch.distributed.barrier()
    if rank == 0:
        write_spec(spec, directory)
    torch.distributed.barrier()


def read_dist(sharded: Any, directory: str, *, checked: bool = False) -> Any:
    """Collective: check that the distributed checkpoint at `directory` has every file it lists, whole (unless
    the caller has just `checked`), then load `sharded` from it; a failure names the file (or the directory,
    when Megatron's own error does not)."""
    from megatron.core import dist_checkpointing

    if not checked:
        check_dist_checkpoint_files(directory)
    try:
        return dist_checkpointing.load(sharded, directory)
    except (Exception, CheckpointException) as e:  # Megatron's and torch's errors rarely name a path
        raise IncompleteCheckpointError(
            directory, f"the distributed checkpoint could not be read (incomplete, corrupt, or saved from another "
                       f"model): {why(e)}") from e


# ---------------------------------------------------------------------- weights alone
def save_weights(module: Any, spec: MoEModelSpec, directory: str) -> None:
    """Collective: Megatron distributed checkpoint of `module`'s weights, written to a temp dir and renamed into
    place (an earlier checkpoint there is replaced whole)."""
    tmp = directory.rstrip("/") + ".tmp"
    write_dist(module.sharded_state_dict(), tmp, spec)
    if torch.distributed.get_rank() == 0:
        old = directory.rstrip("/") + ".old"
        if os.path.exists(directory):
            os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier()


def read_weights(module: Any, directory: str, *, has_adapters: bool) -> tuple[dict[str, Any], bool]:
    """Collective: the state dict of `module` read from `directory` (any layout's weights), and whether it lacks
    the LoRA adapters `module` has (`has_adapters`): a base model's checkpoint, whose adapters keep their values."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no Megatron checkpoint at {directory!r}")
    sharded = module.sharded_state_dict()
    without_adapters = has_adapters and not checkpoint_has_adapters(directory)
    if without_adapters:
        sharded = {k: v for k, v in sharded.items() if ".lora." not in k}
    return read_dist(sharded, directory), without_adapters


def set_weights(module: Any, state: dict[str, Any], *, without_adapters: bool, directory: str) -> None:
    """Load `read_weights`'s state into `module`; without adapters, every base weight must still be set."""
    if without_adapters:
        missing, unexpected = module.load_state_dict(state, strict=False)
        wrong = [k for k in missing if ".lora." not in k] + list(unexpected)
        if wrong:
            raise RuntimeError(f"{directory}: base weights not loaded: {wrong[:4]}")
    else:
        module.load_state_dict(state)


def checkpoint_has_adapters(directory: str) -> bool:
    """Whether the distributed checkpoint at `directory` holds LoRA adapter tensors."""
    check_dist_checkpoint_files(directory)
    keys = FileSystemReader(directory).read_metadata().state_dict_metadata
    return any(".lora." in k for k in keys)


# ---------------------------------------------------------------------- run state (resume, rollback)
def layout_record(layout: ParallelLayout) -> dict[str, int]:
    """The layout a run state was saved at (its RNG files belong to those ranks)."""
    return {"tensor_parallel": layout.tensor_parallel, "expert_parallel": layout.expert_parallel,
            "pipeline_parallel": layout.pipeline_parallel, "world_size": torch.distributed.get_world_size()}


def reference_sharded_state_dict(module: Any, model_sharded: Any, tensors: list[torch.Tensor]) -> dict[int, Any]:
    """The reference weights sharded as the live parameters they stand for, under `reference.<model key>`, so
    they reshard to any layout like the weights do."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                             make_sharded_optimizer_tensor)

    by_index = get_param_id_to_sharded_param_map(model_sharded, module.parameters())
    unkeyed = [name for i, (name, _) in enumerate(module.named_parameters()) if i not in by_index]
    if unkeyed:
        raise RuntimeError(f"parameters without a checkpoint key, so their reference copy cannot be saved: {unkeyed}")
    return {i: make_sharded_optimizer_tensor(by_index[i], tensors[i], prefix="reference") for i in sorted(by_index)}


@dataclass(frozen=True)
class RunStateRecord:
    """What a run state holds besides the tensors: the learner's counters and how it was saved."""

    layout: ParallelLayout
    step_count: int
    lr: float
    params_dtype: torch.dtype


def save_run_state(directory: str, module: Any, optimizer: Any, spec: MoEModelSpec,
                   reference: list[torch.Tensor] | None, record: RunStateRecord) -> None:
    """Collective: everything a learner needs to continue, written into `directory` (created).

    Files: `dist/` (a Megatron distributed checkpoint holding the weights, the optimizer state (Adam moments and
    steps, fp32 main parameters where there are any) and the KL reference weights when set, all sharded per
    model tensor so that any TP/EP/PP layout can load them; it is also a weights checkpoint `read_weights`
    and the export read), `rng_rank{N}.pt` (per global rank: Python, NumPy, torch, CUDA and Megatron's tracker
    generators) and, written last by rank 0, `learner_meta.json` (layout, step count, learning rate, Adam step,
    whether a reference is set, and every file above with its size). Not atomic on its own: the caller writes
    the enclosing directory under a temporary name and renames it."""
    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        for name in os.listdir(directory):  # an earlier attempt's files must not vouch for this one
            if name == RUN_STATE_META or RNG_FILE_RE.fullmatch(name):
                os.remove(os.path.join(directory, name))
    torch.distributed.barrier()
    model = module.sharded_state_dict()
    sharded: dict[str, Any] = {"model": model,
                               "optimizer": optimizer_sharded_state_dict(optimizer, model, is_loading=False)}
    if reference is not None:
        sharded["reference"] = reference_sharded_state_dict(module, model, reference)
    with megatron_write_digests.recording(os.path.join(directory, RUN_STATE_DIST)):  # no second read to hash
        write_dist(sharded, os.path.join(directory, RUN_STATE_DIST), spec)
    torch.save(capture_rng_state(), os.path.join(directory, rng_file(rank)))
    step = adam_step(optimizer)
    torch.distributed.barrier()
    if rank == 0:
        _write_meta(directory, record, adam=step, has_reference=reference is not None)
    torch.distributed.barrier()


def _write_meta(directory: str, record: RunStateRecord, *, adam: int, has_reference: bool) -> None:
    """Rank 0, after every rank wrote its files: `learner_meta.json`, listing each file with its size."""
    files = {rng_file(r): 0 for r in range(torch.distributed.get_world_size())}
    for root, _, names in os.walk(os.path.join(directory, RUN_STATE_DIST)):
        for name in names:  # (a shard's digest file is the run checkpoint's to take, not part of the state)
            if not name.endswith(megatron_write_digests.DIGEST_SUFFIX):
                files[os.path.relpath(os.path.join(root, name), directory)] = 0
    meta = {
        "format": RUN_STATE_FORMAT,
        "layout": layout_record(record.layout),
        "step_count": record.step_count,
        "lr": record.lr,
        "adam_step": adam,
        "has_reference": has_reference,
        "params_dtype": str(record.params_dtype).replace("torch.", ""),
        "files": {rel: os.path.getsize(os.path.join(directory, rel)) for rel in sorted(files)},
    }
    tmp = os.path.join(directory, RUN_STATE_META + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, os.path.join(directory, RUN_STATE_META))


@dataclass
class LoadedRunState:
    """What `load_run_state` read besides the weights and optimizer state it set: for the learner to take on."""

    meta: dict[str, Any]
    """`learner_meta.json` (step count, learning rate, the layout it was saved at)."""
    reference: list[torch.Tensor] | None
    """The KL reference weights, in the live parameters' dtype and device, or None when none was saved."""
    rng: dict[str, Any] | None
    """This rank's RNG states, or None when saved at another layout (they belong to that layout's ranks)."""


def check_run_state(directory: str, spec: MoEModelSpec, layout: ParallelLayout) -> tuple[dict[str, Any], Any]:
    """Collective: every file of the run state at `directory` is whole and holds this model; returns its meta and
    this rank's RNG states (None at another layout). Any rank's failure raises on every rank."""
    dist_dir = os.path.join(directory, RUN_STATE_DIST)

    def check() -> tuple[dict[str, Any], Any]:
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"no learner run state at {directory!r}")
        meta = read_run_state_meta(directory)
        for rel, size in meta["files"].items():
            check_file(os.path.join(directory, rel), size)
        check_dist_checkpoint_files(dist_dir)
        check_same_model(dist_dir, spec)
        rng = None
        if meta["layout"] == layout_record(layout):
            path = os.path.join(directory, rng_file(torch.distributed.get_rank()))
            try:
                rng = torch.load(path, weights_only=True)
            except Exception as e:
                raise IncompleteCheckpointError(path, f"unreadable ({why(e)})") from e
        return meta, rng

    return on_every_rank(check)


def load_run_state(directory: str, module: Any, optimizer: Any, spec: MoEModelSpec, layout: ParallelLayout,
                   *, before_update: Callable[[], None] | None = None) -> LoadedRunState:
    """Collective: check the run state at `directory` (saved at this or any other layout), read it, then set
    `module`'s weights and `optimizer`'s state (a fresh one when it was saved before the first step). Nothing
    changes before every file is checked: a missing, truncated or unreadable one raises
    `IncompleteCheckpointError` naming it. `before_update()` runs just before the weights change."""
    meta, rng = check_run_state(directory, spec, layout)
    model = module.sharded_state_dict()
    sharded: dict[str, Any] = {"model": model}
    if meta["adam_step"] > 0:
        sharded["optimizer"] = optimizer_sharded_state_dict(optimizer, model, is_loading=True)
    params = list(module.parameters())
    if meta["has_reference"]:
        sharded["reference"] = reference_sharded_state_dict(module, model, [p.detach().clone() for p in params])
    state = read_dist(sharded, os.path.join(directory, RUN_STATE_DIST), checked=True)

    if before_update is not None:
        before_update()
    module.load_state_dict(state["model"])
    if meta["adam_step"] > 0:
        # The fp32 main parameters of a mixed-precision optimizer come from the checkpoint (exact), not from the
        # rounded weights; Megatron's own resume does the same and reloads them only without optimizer state.
        load_optimizer_state(optimizer, state["optimizer"], meta["adam_step"])
    else:
        reset_optimizer_state(optimizer)  # also refreshes the fp32 main parameters from the loaded weights
    reference = None
    if meta["has_reference"]:
        loaded = state["reference"]
        reference = [loaded[i].detach().to(device=p.device, dtype=p.dtype) for i, p in enumerate(params)]
    return LoadedRunState(meta=meta, reference=reference, rng=rng)


def check_same_model(dist_dir: str, spec: MoEModelSpec) -> None:
    """The distributed checkpoint at `dist_dir` describes the model `spec` does (else ValueError naming each
    differing field)."""
    path = os.path.join(dist_dir, SPEC_FILE)
    try:
        saved = dataclasses.asdict(read_spec(dist_dir))
    except Exception as e:
        raise IncompleteCheckpointError(path, f"unreadable ({why(e)})") from e
    mine = dataclasses.asdict(spec)
    differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
    if differ:
        raise ValueError(f"the learner checkpoint {dist_dir} holds another model: "
                         + ", ".join(f"{k}={saved.get(k)!r} (this learner: {mine.get(k)!r})" for k in differ))
