"""The bookkeeping of served LoRA adapters (rollout/lora_serving.py), without an engine."""

from types import SimpleNamespace

import pytest

from moe_grpo.rollout.lora_serving import ServedAdapter, ServedAdapters, max_lora_rank, target_modules


def _adapter(version: int, lora_id: int, directory) -> ServedAdapter:
    directory.mkdir()
    return ServedAdapter(version, SimpleNamespace(lora_int_id=lora_id), directory, owned=True)


def test_an_old_adapter_is_retired_once_its_last_request_ends_and_its_directory_goes(tmp_path):
    served = ServedAdapters(tmp_path)
    v1, v2, v3 = (_adapter(v, v, tmp_path / f"v{v}") for v in (1, 2, 3))
    assert served.switch(v1) == [] and served.acquire() is v1
    assert served.switch(v2) == [], "v1 still has a request in flight"
    assert served.acquire() is v2 and served.switch(v3) == [], "v1 and v2 both still in use"
    idle = served.release(v1)
    assert idle == [v1] and served.release(v2) == [v2] and served.current is v3 and not served.older
    for adapter in idle:
        served.discard(adapter)
    assert not (tmp_path / "v1").exists() and (tmp_path / "v2").exists()
    served.close()
    assert not tmp_path.exists()


def test_vllms_rank_limits_and_the_modules_it_wraps():
    assert [max_lora_rank(r) for r in (1, 4, 8, 16, 17, 512)] == [1, 8, 8, 16, 32, 512]
    with pytest.raises(ValueError, match="lora.rank=600: vLLM serves adapters up to rank 512"):
        max_lora_rank(600)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight",
             "model.layers.0.mlp.down_proj.weight"]
    assert target_modules(names) == ["down_proj", "q_proj"]
