"""The imports that stay inside functions, and why; every other import goes at the top of its module.

A module imports what it uses at its top. The exception is a package in `DEFERRED`: heavy or optional, it must
stay out of the paths that run without it, so the functions that need it import it where they run:

- `python -m moe_grpo.train --help`, a config error and `cluster.dry_run=true` answer in about a second, with
  no torch, Ray, vLLM or megatron-core imported (tests/orchestrator/test_placement_plan.py checks the dry run);
- `python -m moe_grpo.evaluate --help` and the tools' `--help` likewise;
- a learner process never imports vLLM, an engine never imports megatron-core, and the optional extras (hf,
  wandb, mlflow, lora) are imported only by the runs that asked for them.

So an import inside a function is one of:
- a package named here, in a module whose own top-level imports do not already bring it in (there the deferral
  would hide nothing);
- a moe_grpo module whose top-level imports bring in a package named here that the importing module does not;
- an import inside a `try` that handles ImportError: an optional package asked for by name, its absence named.

tests/test_imports.py reads every module of the package (the source, nothing is imported) and fails on any
other import inside a function, naming its file and line.
"""

from __future__ import annotations

DEFERRED: dict[str, str] = {
    "torch": "about 1.5 s to import; --help, config errors and the dry run answer without it",
    "ray": "about 1 s; only a run or an evaluation starts Ray, not --help or the dry run",
    "vllm": "the engine-cpu / gpu extra: learner processes and learner-only installs run without it",
    "megatron": "megatron-core, the learner's; engines and the dry run run without it",
    "transformer_engine": "GPU learners only (the gpu extra)",
    "transformers": "the hf extra: conversion's --verify, init.hf's tokenizer; runs on the byte tokenizer lack it",
    "peft": "the lora extra: only the PEFT checks use it",
    "wandb": "the wandb extra: only a run with logger.wandb=true",
    "mlflow": "the mlflow extra: only a run with logger.mlflow=true",
    "safetensors": "its torch half imports torch",
    "tensorboard": "the run record's event files; imports torch's writer",
    "matplotlib": "about 0.5 s; only the run record's PNG at the end of a run",
    "pyarrow": "only for data.train_path / data.eval_path in Parquet",
    "math_verify": "brings sympy (about 1 s); only the math reward scores with it",
    "triton": "GPU kernels: never needed on a CPU machine",
}
"""Top-level package -> why imports of it wait inside the functions that use it."""
