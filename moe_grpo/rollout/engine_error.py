"""The one error a vLLM engine raises (rollout/vllm_engine.py and the modules it is built from)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The vLLM engine failed (start, generation, weight load, dead or hung); names the engine and the step."""
