"""Entry point: `python -m moe_grpo.train model=deepseek_moe [overrides...]`.

Composes the Hydra config, converts it once into `RunConfig`, and runs. Heavy
libraries (torch, megatron-core) are imported only after the config is
composed, so `--help` and config errors answer at once.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

NOT_BUILT = (
    "moe_grpo: stopping here. The Megatron learner, routing replay, the vLLM rollout engine and the weight sync "
    "are built and checked above; the reward tasks and the asynchronous GRPO loop are not built yet (README, 'Status'). "
    "The one learner step used random advantages; nothing was trained toward a reward. Exit status 2."
)
_exit_code = 0


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _exit_code
    from moe_grpo.config import from_hydra
    from moe_grpo.learner.preflight import engine_preflight, learner_preflight

    run = from_hydra(cfg)
    learner = learner_preflight(run)
    if run.parallel.world_size() == 1:
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("[engine] vLLM is not installed (bash tools/install.sh engine); skipping the rollout check",
                  file=sys.stderr)
        else:
            engine_preflight(run, learner)
    print(NOT_BUILT, file=sys.stderr)
    _exit_code = 2


def cli() -> None:
    import warnings

    from moe_grpo.config import defaults_tree

    # On CPU megatron-core announces, once per module, that TE/Apex are absent; we know.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated.*")

    ConfigStore.instance().store(name="moe_grpo_defaults", node=defaults_tree())
    main()
    sys.exit(_exit_code)


if __name__ == "__main__":
    cli()
