"""Entry point: `python -m moe_grpo.train model=deepseek_moe [overrides...]`.

Composes the Hydra config, converts it once into `RunConfig`, and hands it to
the driver (`orchestrator/driver.py`). Heavy libraries (torch, Ray, vLLM,
megatron-core) are imported only after the config is composed, so `--help`
and config errors answer at once.
"""

from __future__ import annotations

import math
import os
import secrets
import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

_exit_code = 0


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from moe_grpo.config import from_hydra
    from moe_grpo.orchestrator.driver import train
    from moe_grpo.orchestrator.run_dirs import check_run_dir

    global _exit_code
    try:
        run = from_hydra(cfg)
    except ValueError as e:  # a value the user wrote: the message names the key, a traceback would only bury it
        _exit_code = 2  # usage error, as argparse reports one
        print(f"[moe_grpo] config error: {e}", file=sys.stderr)
        return
    run_dir = HydraConfig.get().runtime.output_dir
    check_run_dir(run_dir, run.resume)  # again on the resolved directory (set in a YAML file, say)
    with open(f"{run_dir}/config.yaml", "w") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))
    summary = train(run, run_dir)
    if summary["stopped"]:
        _exit_code = 128 + 15  # what a shell reports for SIGTERM: schedulers see the run did not finish
        print(f"[moe_grpo] stopped by {summary['stopped']} after step {summary['steps']}; checkpoint "
              f"{summary['checkpoint']}; continue with the same command and resume=true hydra.run.dir={run_dir}",
              file=sys.stderr)
        return
    faults = {k: v for k, v in summary["faults"].items() if v}
    print(f"[moe_grpo] {summary['steps']} steps in {summary['seconds'] / 60:.1f} min ({run.mode}); held-out reward "
          f"{_score(summary['eval_start'])} at step 0 -> {_score(summary['eval_end'])} at the end; "
          + (f"faults survived: {', '.join(f'{k} {v}' for k, v in faults.items())}; " if faults else "")
          + f"record in {run_dir}", file=sys.stderr)


def _score(value: float | None) -> str:
    """A held-out reward for the last line; NaN or None when none was measured (eval_every=0, no held-out set)."""
    return f"{value:.3f}" if isinstance(value, (int, float)) and math.isfinite(value) else "not measured"


RUN_ID = f"{os.getpid()}-{secrets.token_hex(3)}"
"""This process's `${unique:}` (conf/config.yaml's run directory): two runs started in the same second differ."""


def refuse_taken_run_dir(argv: list[str]) -> None:
    """Exit (code 2) when `hydra.run.dir=` on the command line names a directory holding another run's record and
    `resume=true` is not given. Runs before Hydra, which writes `.hydra/` into the run directory before `main`: a
    refused run writes nothing. (Parsed with Hydra's own override grammar; `main` checks again on the resolved
    directory.)"""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from moe_grpo.orchestrator.run_dirs import RunDirTaken, check_run_dir

    args = [a for a in argv if not a.startswith("-")]
    try:
        overrides = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(args)}
    except Exception:  # noqa: BLE001 - Hydra reports a malformed override itself, with its position
        return
    run_dir = overrides.get("hydra.run.dir")
    resume = str(overrides.get("resume", "false")).lower() == "true"
    if isinstance(run_dir, str):
        try:
            check_run_dir(os.path.abspath(run_dir), resume)
        except RunDirTaken as e:
            print(f"[moe_grpo] {e}", file=sys.stderr)
            sys.exit(2)


def cli() -> None:
    from omegaconf import OmegaConf

    from moe_grpo.config import defaults_tree
    from moe_grpo.orchestrator.logs import quiet_libraries

    refuse_taken_run_dir(sys.argv[1:])
    quiet_libraries()
    OmegaConf.register_new_resolver("unique", lambda: RUN_ID, replace=True)
    ConfigStore.instance().store(name="moe_grpo_defaults", node=defaults_tree())
    main()
    sys.exit(_exit_code)


if __name__ == "__main__":
    cli()
