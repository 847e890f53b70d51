"""An engine loads each published version at most once (issue 32, Show: "every version loaded by both workers once").

`tests/rollout/test_engine_tensor_parallel_faults.py` shows, with a real TP=2 engine, that one `apply_version` loads
each tensor of a version into both workers exactly once. Over a whole run the other half of "once" is that
no version is applied to an engine twice: the engine pool offers every version to every engine, and offers the
newest again to an engine that missed one (orchestrator/engine_pool.py), so what keeps a version from being
loaded a second time is `apply_version`'s refusal of any version at or below the one the engine serves. This
test holds that refusal to account on a stand-in engine that records its loads (no vLLM: the refusal comes
before anything reaches an engine's workers).

What it would catch: an engine handed a version it already serves (or an older one) reloading it, which at
TP > 1 means every worker loading it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

import layout_scenarios as S
from moe_grpo.sync.deliver import apply_version
from moe_grpo.sync.transport import SharedMemoryTransport, SyncError
from publishing import publish_version


@dataclass
class RecordingEngine:
    """What `apply_version` reads of an engine; `load_published` records each load instead of reaching workers."""

    spec: Any
    engine_id: str = "recording"
    policy_version: int = 0
    dtype: str = "float32"
    weight_source: Any = "model_dir"
    lora: Any = None
    broken: Any = None
    loads: list[int] = field(default_factory=list)

    def load_published(self, slot, plan, version, *, sources, only, timeout_s) -> None:
        self.loads.append(version)
        self.policy_version, self.weight_source = version, (slot, plan, sources)


def test_a_version_is_loaded_once_and_offered_again_is_refused_without_a_load(tmp_path):
    spec = S.tiny_spec()
    transport = SharedMemoryTransport(str(tmp_path / "shm"))
    engine = RecordingEngine(spec)
    for version in (1, 2):
        publish_version(transport, version, spec, fill=float(version))
        apply_version(engine, transport, version, timeout_s=10)
    for again in (2, 1):  # the version it serves, then an older one still in a slot
        with pytest.raises(SyncError, match=rf"engine recording already serves version 2; refused version {again}"):
            apply_version(engine, transport, again, timeout_s=10)
    publish_version(transport, 3, spec, fill=3.0)
    apply_version(engine, transport, 3, timeout_s=10)
    assert engine.loads == [1, 2, 3], engine.loads
    assert engine.policy_version == 3
