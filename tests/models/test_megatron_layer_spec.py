"""The learner's Megatron modules do not depend on what else is installed."""

import sys
import types

import torch

from moe_grpo.config import load_model_spec


def test_the_learner_builds_megatrons_local_modules_even_where_transformer_engine_is_installed(monkeypatch):
    """Would have caught: the TE spec chosen because `transformer_engine` imports on a CUDA machine (as in NGC
    containers, or after an install that pulled TE in): its fused norm names are refused by the weight sync."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from moe_grpo.models.megatron import MegatronOptions, layer_spec, transformer_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    spec = load_model_spec("deepseek_moe")
    with torch.device("meta"):
        config = transformer_config(spec, MegatronOptions(perform_initialization=False))
    block = layer_spec(spec, config, pp_rank=0)  # one stage: no process group needed
    attention = [layer.submodules.self_attention.submodules for layer in block.layer_specs]
    assert attention and all(a.linear_qkv is ColumnParallelLinear for a in attention), \
        [a.linear_qkv for a in attention]
