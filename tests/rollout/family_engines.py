"""One one-worker engine per test_families checkpoint for the whole test session, shared by the modules that serve
it the same way (test_families.py, test_engine_tensor_parallel.py's TP=1 side): each start of vLLM costs ~20 s on
2 cores (an engine core and a worker process, each importing vLLM), and a fresh process is not what these tests
are about. Tests of start, restart, death and cleanup start their own engines.

A module `acquire`s a family's engine (started on first use) and `release`s it at its end. Released, it is handed
on only as found: alive, nothing in flight, no routing buffer held, capture on, no adapter, and serving the
checkpoint's own weights again (reloaded when a module left others, and checked against the digests it had when it
started: equal digests, equal bits). `acquire` checks the same before handing it out; a module that finds it
otherwise fails naming what was left. It is shut down once no later module of the session uses it.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from publishing import serve_published

USERS = {"test_families.py": "family", "test_engine_tensor_parallel.py": "served",
         "test_engine_pipeline_parallel.py": "served"}
"""Test module -> the module-scoped fixture (parametrized by family name) through which its tests use the engine."""


@dataclass
class FamilyEngine:
    name: str
    root: Path
    """The family's directory: hf/ the checkpoint transformers wrote."""
    hf: str
    model: Any
    """The transformers model that wrote the checkpoint (the reference)."""
    spec: Any
    engine: Any
    start_digests: dict[str, str] = field(default_factory=dict)
    """What the engine served when it started from `hf`: the state it is handed on in."""


_engines: dict[str, FamilyEngine] = {}


def acquire(name: str, tmp_path_factory) -> FamilyEngine:
    """The session's engine on family `name`'s checkpoint (max_model_len 256, 8 sequences), as found."""
    if name in _engines:
        fam = _engines[name]
        left = not_as_found(fam)
        assert not left, f"the shared {name} engine was handed on changed: {left}"
        return fam
    from moe_grpo.models.hf_config import read_hf_config, spec_from_hf_config
    from moe_grpo.rollout.vllm_engine import VllmEngine
    from test_families import write_checkpoint

    root = tmp_path_factory.mktemp(name)
    hf = str(root / "hf")
    model = write_checkpoint(name, hf)
    # Named as checkpoint.convert names the Megatron checkpoint's spec (its directory's name): the learners' syncs
    # carry that name, and an engine refuses a version for a model of another name.
    spec = spec_from_hf_config(read_hf_config(hf), name=Path(hf).name)
    engine = VllmEngine(hf, spec, max_model_len=256, max_num_seqs=8)
    fam = FamilyEngine(name, root, hf, model, spec, engine)
    fam.start_digests = engine.weight_digests()
    if not _engines:
        atexit.register(shutdown_all)  # a session that stops early (-x) ends them with the process
    _engines[name] = fam
    return fam


def not_as_found(fam: FamilyEngine) -> dict[str, Any]:
    """What differs from an engine just started on the checkpoint (empty when nothing does)."""
    engine = fam.engine
    left = {"not alive": not engine.alive(), "closing": engine.closing, "broken": engine.broken,
            "requests in flight": engine.in_flight(), "routing buffers": engine.num_routing_buffers(),
            "capture off": not engine.capture, "adapter": engine.lora is not None}
    left = {k: v for k, v in left.items() if v}
    if not left:
        changed = sorted(n for n, d in engine.weight_digests().items() if fam.start_digests.get(n) != d)
        if changed or set(engine.weight_digests()) != set(fam.start_digests):
            left["weights other than the checkpoint's"] = changed[:5] or "other tensor names"
    return left


def release(name: str, request) -> None:
    """The module using family `name`'s engine is done: shut it down unless a later module of the session uses it;
    then it is handed on with the checkpoint's weights reloaded (a new version) and checked as found."""
    fam = _engines.get(name)
    if fam is None:
        return
    if not _used_later(name, request):
        _engines.pop(name)
        fam.engine.shutdown()
        return
    from moe_grpo.checkpoint.hf_io import SafetensorsDir
    from moe_grpo.models.hf_names import hf_names

    files = SafetensorsDir(fam.hf)
    serve_published(fam.engine, {n: files.get(n).float() for n in hf_names(fam.spec)}, fam.engine.policy_version + 1)
    left = not_as_found(fam)
    if left:  # not handed on: the next module starts a fresh one
        _engines.pop(name)
        fam.engine.shutdown()
        raise AssertionError(f"the shared {name} engine is left changed by {request.module.__name__}: {left}")


def shutdown_all() -> None:
    while _engines:
        _engines.popitem()[1].engine.shutdown()


def _used_later(name: str, request) -> bool:
    """Whether a module that runs after `request`'s module in this session uses family `name`'s engine."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if getattr(item, "module", None) is request.module]
    for item in items[(max(mine) + 1 if mine else 0):]:
        fixture = USERS.get(Path(str(getattr(item, "fspath", ""))).name)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if fixture and params.get(fixture) == name and getattr(item, "module", None) is not request.module:
            return True
    return False
