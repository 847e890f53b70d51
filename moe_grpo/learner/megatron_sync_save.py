"""megatron-core's synchronous checkpoint save without the process it spawns to pass results to itself.

Targets megatron-core == 0.16.1 (`TARGET_VERSION`). `dist_checkpointing.save` (the torch_dist strategy) writes
through `FileSystemWriterAsync`, whose `prepare_write_data` takes the module-global results queue from
`filesystem_async._get_write_results_queue()`: on a process's first save that starts
`mp.get_context("spawn").Manager()`, a fresh interpreter that imports the parent's main module (in a Ray learner
actor, Ray's worker and Ray), ~2.3 of the 2.5 s of each learner rank's first checkpoint in a run on 2 cores
(cProfile, 2026-11-27), and a server process left running beside the learner until it exits.

The queue carries something across processes only for megatron's asynchronous saves, where the writer runs in a
persistent worker process. A synchronous save (`AsyncRequest.execute_sync`, all the learner does) puts the writers'
results in and takes them out in the saving process itself: `write_preloaded_data_multiproc` `put`s the dict it
collected from its forked writer processes (through their own fork-context queue), `retrieve_write_results`
`get_nowait`s it. Inside `in_process_results()` the module's global queue is a `queue.Queue`, which has both
methods; the previous value is restored after, so an asynchronous save elsewhere in the process still gets
megatron's own Manager queue. Nothing else of the save changes (the writer processes are megatron's, forked as
before)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import queue
import threading
from typing import Any, Iterator

TARGET_VERSION = "0.16.1"
_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_GLOBAL = "_results_queue"
_LINE = "_results_queue = ctx.Manager().Queue()"
"""The line of `_get_write_results_queue` this replaces for the length of a save."""

_lock = threading.Lock()


def _writer_module() -> Any:
    from moe_grpo.learner.megatron_cpu import megatron_version

    version = megatron_version()
    if version != TARGET_VERSION:
        raise RuntimeError(f"moe_grpo.learner.megatron_sync_save targets megatron-core=={TARGET_VERSION}, found "
                           f"{version}; re-read filesystem_async._get_write_results_queue before changing it")
    module = importlib.import_module(_MODULE)
    source = inspect.getsource(module._get_write_results_queue)
    if _LINE not in source or not hasattr(module, _GLOBAL):
        raise RuntimeError(f"{_MODULE}._get_write_results_queue no longer has {_LINE!r}; the in-process results "
                           "queue of synchronous saves does not apply")
    return module


@contextlib.contextmanager
def in_process_results() -> Iterator[None]:
    """Within the block, megatron-core's checkpoint writer passes its results through an in-process queue: for
    synchronous `dist_checkpointing.save` calls only (see the module's docstring). One save at a time per process."""
    module = _writer_module()
    with _lock:
        previous = getattr(module, _GLOBAL)
        setattr(module, _GLOBAL, queue.Queue())
        try:
            yield
        finally:
            setattr(module, _GLOBAL, previous)
