"""The engines' start directory of a (resumed) run: older exports of the run are removed once a new one is made."""

import os

from moe_grpo.orchestrator.initial_weights import drop_older_exports


def test_a_resume_keeps_only_the_start_directory_its_engines_use(tmp_path):
    """Each resume exported the version it resumed at (`model_v<step>/`, a whole model) and none was ever removed:
    a model's size on disk per preemption (a user's trial, 2026-11-28)."""
    for name in ("model_v0", "model_v7", "model_v20"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x")
    checkpoint = tmp_path / "outside"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    os.symlink(checkpoint / "model.safetensors", tmp_path / "model_v7" / "linked.safetensors")  # an init.hf view
    (tmp_path / "model_vision").mkdir()  # not an export
    (tmp_path / "policy").mkdir()
    assert drop_older_exports(str(tmp_path), keep=str(tmp_path / "model_v20")) == ["model_v0", "model_v7"]
    assert sorted(os.listdir(tmp_path)) == ["model_v20", "model_vision", "outside", "policy"]
    assert (checkpoint / "model.safetensors").read_bytes() == b"weights", "a view's targets are not touched"
