"""Entry point: `python -m moe_grpo.train model=deepseek_moe [overrides...]`.

Composes the Hydra config, converts it once into `RunConfig`, and hands it to
the run (`orchestrator/training_run.py`). Heavy libraries (torch, Ray, vLLM,
megatron-core) are imported only after the config is composed, so `--help`
and config errors answer at once.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from moe_grpo.command_line import (closing_line, config_error, dry_run_dir, part_failed, refusal, refuse_bad_config,
                                   refuse_taken_run_dir)
from moe_grpo.config import defaults_tree, from_hydra
from moe_grpo.orchestrator.training_run import PART_FAILURES, SignalledTogether, train
from moe_grpo.orchestrator.logs import quiet_libraries
from moe_grpo.orchestrator.placement_plan import PlanRefused, dry_run
from moe_grpo.orchestrator.run_checkpoint import ResumeRefused
from moe_grpo.orchestrator.run_dirs import RunDirTaken, check_run_dir
from moe_grpo.sync.errors import UnsafeRootError
from moe_grpo.validate import InputRefused

_exit_code = 0


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _exit_code
    try:
        run = from_hydra(cfg)
    except ValueError as e:  # refuse_bad_config saw it first, unless the command line had flags (--cfg, -m)
        _exit_code = config_error(e)
        return
    if run.cluster.dry_run:
        _exit_code = dry_run(run)
        return
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        check_run_dir(run_dir, run.resume)  # again on the resolved directory (set in a YAML file, say)
        summary = train(run, run_dir, config_yaml=OmegaConf.to_yaml(cfg, resolve=True))
    except (PlanRefused, ResumeRefused, InputRefused, RunDirTaken, UnsafeRootError) as e:  # they name what to change
        _exit_code = refusal(e)
        return
    except PART_FAILURES as e:  # a part failed past repair: the reason, not the driver's traceback
        _exit_code = part_failed(e)
        return
    except SignalledTogether as e:  # what a scheduler's kill looks like: exit as a shell reports the signal
        _exit_code = 128 + signal.Signals[e.signal_name]
        print(f"[moe_grpo] {e}", file=sys.stderr)
        return
    if summary["stopped"]:
        _exit_code = 128 + signal.Signals[summary["stopped"]]  # as a shell reports it (143 for SIGTERM)
        print(f"[moe_grpo] stopped by {summary['stopped']} after step {summary['steps']}; checkpoint "
              f"{summary['checkpoint']}; continue with the same command and resume=true hydra.run.dir={run_dir}",
              file=sys.stderr)
        return
    print(closing_line(summary, run.mode, run_dir), file=sys.stderr)


RUN_ID = f"{os.getpid()}-{secrets.token_hex(3)}"
"""This process's `${unique:}` (conf/config.yaml's run directory): two runs started in the same second differ."""


def cli() -> None:
    refuse_taken_run_dir(sys.argv[1:])
    sys.argv += dry_run_dir(sys.argv[1:])
    quiet_libraries()
    OmegaConf.register_new_resolver("unique", lambda: RUN_ID, replace=True)
    ConfigStore.instance().store(name="moe_grpo_defaults", node=defaults_tree())
    refuse_bad_config(sys.argv[1:])
    main()
    sys.exit(_exit_code)


if __name__ == "__main__":
    cli()
