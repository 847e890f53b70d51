"""Entry point: `python -m moe_grpo.evaluate policy=DIR [overrides...]`: greedy accuracy and pass@k of a policy.

Composes conf/evaluate.yaml over `EvaluateConfig` (moe_grpo/evaluation/config.py) and hands it to
`evaluation.run.evaluate`. torch and vLLM are imported only after the config is composed, so `--help` and config
errors answer at once.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from moe_grpo.command_line import config_error, part_failed, refusal, refuse_bad_config
from moe_grpo.evaluation.config import defaults_tree, from_hydra, unknown_key
from moe_grpo.evaluation.run import SUMMARY, evaluate
from moe_grpo.orchestrator.logs import quiet_libraries
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.validate import InputRefused

_exit_code = 0


@hydra.main(version_base="1.3", config_path="../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    global _exit_code
    try:
        config = from_hydra(cfg)
    except ValueError as e:  # refuse_bad_config saw it first, unless the command line had flags (--cfg, -m)
        _exit_code = config_error(e)
        return
    out_dir = config.output or HydraConfig.get().runtime.output_dir
    try:
        summary = evaluate(config, out_dir)
    except InputRefused as e:  # the message names the file, the row or the dotted path
        _exit_code = refusal(e)
        return
    except EngineError as e:  # vLLM could not start (the cause it logged) or failed: one line, not a traceback
        _exit_code = part_failed(e)
        return
    passes = "".join(f", pass@{k} {summary[f'pass@{k}']:.3f}" for k in config.pass_k if f"pass@{k}" in summary)
    print(f"[moe_grpo] {summary['rows']} prompts of {summary['dataset']}: greedy accuracy "
          f"{summary['greedy']['accuracy']:.3f} (reward mean {summary['greedy']['reward_mean']:.3f})"
          f"{passes}{f' ({config.samples} samples per prompt)' if config.samples else ''}; "
          f"{f'{n} bad row(s) skipped (logged above); ' if (n := summary.get('bad_rows')) else ''}"
          f"{out_dir}/{SUMMARY}", file=sys.stderr)


def cli() -> None:
    quiet_libraries()
    ConfigStore.instance().store(name="evaluate_defaults", node=defaults_tree())
    refuse_bad_config(sys.argv[1:], "evaluate", unknown_key, from_hydra)
    main()
    sys.exit(_exit_code)


if __name__ == "__main__":
    cli()
