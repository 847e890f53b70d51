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
    from moe_grpo.orchestrator.placement_plan import PlanRefused
    from moe_grpo.orchestrator.run_dirs import check_run_dir

    global _exit_code
    try:
        run = from_hydra(cfg)
    except ValueError as e:  # a value the user wrote: the message names the key, a traceback would only bury it
        _exit_code = 2  # usage error, as argparse reports one
        print(f"[moe_grpo] config error: {e}", file=sys.stderr)
        return
    if run.cluster.dry_run:
        _exit_code = dry_run(run)
        return
    run_dir = HydraConfig.get().runtime.output_dir
    check_run_dir(run_dir, run.resume)  # again on the resolved directory (set in a YAML file, say)
    with open(f"{run_dir}/config.yaml", "w") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))
    try:
        summary = train(run, run_dir)
    except PlanRefused as e:  # the plan was printed above it; the reasons name the numbers
        _exit_code = 2
        print(f"[moe_grpo] {e}", file=sys.stderr)
        return
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


def dry_run(run: "RunConfig") -> int:  # noqa: F821 - annotation only
    """`cluster.dry_run=true`: print the placement plan (the prompts are read for the context length, nothing is
    started) and return the exit status: 0 when it fits, 2 with the reasons when it is refused."""
    import numpy as np

    from moe_grpo.data.prompts import engine_context, prompt_source
    from moe_grpo.data.tokenizer import load_tokenizer
    from moe_grpo.orchestrator.placement_plan import build_plan, not_runnable_yet

    seq_len = run.rollout.max_model_len
    if not seq_len:
        try:
            source = prompt_source(run, load_tokenizer(run.model, run.init.hf), np.random.default_rng(run.seed))
            seq_len = engine_context(run, source)
        except ValueError as e:  # a prompt that does not fit the model: what the run would stop on too
            print(f"[moe_grpo] config error: {e}", file=sys.stderr)
            return 2
    plan = build_plan(run, seq_len=seq_len)
    print(plan.render())
    for limit in not_runnable_yet(plan):
        print(f"note: a run of this plan stops at start in this build: {limit}")
    if not plan.ok:
        print(f"[moe_grpo] {plan.refusal()}", file=sys.stderr)
        return 2
    return 0


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
    from moe_grpo.orchestrator.run_dirs import RunDirTaken, check_run_dir

    overrides = _overrides(argv)
    if str(overrides.get("cluster.dry_run", "false")).lower() == "true":
        return  # a dry run writes no record
    run_dir = overrides.get("hydra.run.dir")
    resume = str(overrides.get("resume", "false")).lower() == "true"
    if isinstance(run_dir, str):
        try:
            check_run_dir(os.path.abspath(run_dir), resume)
        except RunDirTaken as e:
            print(f"[moe_grpo] {e}", file=sys.stderr)
            sys.exit(2)


def _overrides(argv: list[str]) -> dict[str, object]:
    """The command line's overrides by key, parsed with Hydra's own grammar ({} when one is malformed: Hydra reports
    it itself, with its position)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in argv if not a.startswith("-")]
    try:
        return {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(args)}
    except Exception:  # noqa: BLE001
        return {}


def _dry_run_dir(argv: list[str]) -> list[str]:
    """`cluster.dry_run=true` without a run directory of its own: Hydra's files go to a temporary directory removed
    at exit, so a dry run leaves nothing under outputs/."""
    overrides = _overrides(argv)
    if str(overrides.get("cluster.dry_run", "false")).lower() != "true" or "hydra.run.dir" in overrides:
        return []
    import atexit
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="moe_grpo-dry-run-")
    atexit.register(shutil.rmtree, tmp, True)
    return [f"hydra.run.dir={tmp}", "hydra.output_subdir=null"]


def cli() -> None:
    from omegaconf import OmegaConf

    from moe_grpo.config import defaults_tree
    from moe_grpo.orchestrator.logs import quiet_libraries

    refuse_taken_run_dir(sys.argv[1:])
    sys.argv += _dry_run_dir(sys.argv[1:])
    quiet_libraries()
    OmegaConf.register_new_resolver("unique", lambda: RUN_ID, replace=True)
    ConfigStore.instance().store(name="moe_grpo_defaults", node=defaults_tree())
    main()
    sys.exit(_exit_code)


if __name__ == "__main__":
    cli()
