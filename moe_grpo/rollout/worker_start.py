"""How an engine's vLLM workers start: forked from vLLM's engine core, not spawned.

vLLM's CPU platform sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` in the process that builds the engine's config (an
engine actor, a test, a tool: processes with threads that ran OpenMP, which must not fork), and its engine core
inherits that, so each worker was a fresh interpreter importing vLLM again: 8-12 s of every engine start and
restart on 2 cores (tools/bench_engine_start.py). The engine core itself is forked from a process server that
only imported vLLM (rollout/engine_core_start.py; spawned where that is not installed), has run no OpenMP region when
it starts its workers (the model is built in the workers) and is what vLLM forks workers from by default on GPU.
`ForkedWorkersExecutor` is vLLM's multiprocessing executor with that env var set to `fork` in the engine core
before the workers start; vLLM still spawns where it must (`vllm.utils.system_utils._maybe_force_spawn`: CUDA
already initialised, a Ray actor). A forked worker sets its own OpenMP threads and their cores
(`init_cpu_threads_env`), as a spawned one does.

Passed to vLLM as `distributed_executor_backend` (a class: vLLM's documented way to choose an executor), so it
runs in the engine core (vllm 0.32: `MultiprocExecutor._init_executor`).
"""

from __future__ import annotations

import os

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


class ForkedWorkersExecutor(MultiprocExecutor):
    """vLLM's multiprocessing executor whose workers are forked from the engine core (module docstring)."""

    def _init_executor(self) -> None:
        os.environ[START_METHOD_ENV] = "fork"
        super()._init_executor()
