"""Patches of vLLM internals, applied inside vLLM worker processes. Targets vllm(-cpu) == 0.32.0.

cpu_moe_reload_prepack: on a weight *update*, `UnquantizedFusedMoEMethod._setup_kernel`
(model_executor/layers/fused_moe/unquantized_fused_moe_method.py) rebuilds the kernel but
skips `fused_experts.process_weights_after_loading`, which on CPU is the expert-weight
prepack of `CPUUnquantizedExperts` (experts/cpu_moe.py). Reloaded experts then compute
with stale packed weights (log-probs off by ~0.1 on the tiny model). The patch re-runs
the prepack when the kernel already existed. Only layers being reloaded pass through
`_setup_kernel`, so nothing is packed twice.
"""

from __future__ import annotations

TARGET_VERSION = "0.32.0"
_applied: dict[str, object] = {}


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def apply_cpu_moe_reload_prepack() -> bool:
    """Install the patch in this process (a vLLM worker). Returns False if already installed."""
    if "cpu_moe_reload_prepack" in _applied:
        return False
    version = vllm_version().split("+")[0]
    if version != TARGET_VERSION:
        raise RuntimeError(f"moe_grpo.rollout.vllm_patches targets vLLM {TARGET_VERSION}, found {version}; "
                           "re-check the patch against the new release")
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m

    cls = m.UnquantizedFusedMoEMethod
    original = cls._setup_kernel

    def _setup_kernel(self, layer, w13, w2):  # type: ignore[no-untyped-def]
        updating = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if updating:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    cls._setup_kernel = _setup_kernel
    _applied["cpu_moe_reload_prepack"] = (cls, original)
    return True


def revert_all() -> None:
    for name, (cls, original) in list(_applied.items()):
        cls._setup_kernel = original  # type: ignore[attr-defined]
        _applied.pop(name)
