"""What `python -m moe_grpo.train` (and `moe_grpo.evaluate`) checks on its command line before Hydra composes
anything (Hydra writes `.hydra/` into the run directory before `main` runs, so these checks must come first to leave
nothing behind)."""

from __future__ import annotations

import atexit
import math
import os
import shutil
import sys
import tempfile
import traceback
from typing import Any, Callable

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser

from moe_grpo import config
from moe_grpo.orchestrator.run_dirs import RunDirTaken, check_run_dir, driving, unwritable


def refuse_bad_config(argv: list[str], config_name: str = "config",
                      unknown_key: Callable[[str], str | None] = config.unknown_key,
                      convert: Callable[[Any], Any] = config.from_hydra) -> None:
    """Exit (code 2, one line `[moe_grpo] config error: ...`) when an override names a key nothing reads (with the
    nearest known one: `unknown_key`) or a value its field refuses. The config (conf/<config_name>.yaml) is composed
    and converted (`convert`) here as the entry point's main will, before Hydra creates the run directory: a
    mistyped command leaves nothing under outputs/. Needs the defaults stored in Hydra's ConfigStore. Command lines
    with flags (--help, --cfg, -m) and what Hydra itself cannot compose (a model=<name> that does not exist, a
    malformed override) are left to Hydra, which names them."""
    if any(a.startswith("-") for a in argv):
        return
    try:
        overrides = OverridesParser.create().parse_overrides(list(argv))
    except Exception:  # noqa: BLE001
        return
    try:
        for o in overrides:
            if not (o.is_hydra_override() or o.is_add() or o.is_delete()):
                problem = unknown_key(o.key_or_group)
                if problem:
                    raise ValueError(problem)
        try:
            with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base="1.3"):
                cfg = compose(config_name=config_name, overrides=list(argv))
        except Exception:  # noqa: BLE001  (Hydra's own errors: its message, from hydra.main)
            return
        convert(cfg)
    except ValueError as e:
        sys.exit(config_error(e))


def config_error(e: ValueError) -> int:
    """Report a config the user wrote wrong in one line (the message names the key; a traceback would only bury
    it) and return the exit status: 2, a usage error, as argparse reports one."""
    print(f"[moe_grpo] config error: {e}", file=sys.stderr)
    return 2


def refusal(e: Exception) -> int:
    """Report a run refused before it started (its inputs, its plan, its resume, its weight-sync root) in one line
    and return the exit status: 2, as a config error; the message names the file, row, key or numbers."""
    print(f"[moe_grpo] {e}", file=sys.stderr)
    return 2


def part_failed(e: BaseException, log: str | None = None) -> int:
    """Report a run stopped by a part that failed past what the run repairs (a learner rank, an engine that cannot
    start or keeps failing, a reward or engine failing on everything) in one line, the traceback appended to the
    run's log, and return the exit status: 1. The driver's traceback says only where it waited; the message names
    the part, the cause and the checkpoint to resume from (an error that crossed Ray, whose text is its whole remote
    traceback: the original's message). `log`: the run's log file (None: Hydra's job log)."""
    cause = getattr(e, "cause", None)  # Ray's RayTaskError keeps the exception raised in the actor
    reason = " ".join(str(cause if isinstance(cause, BaseException) else e).split())
    if log is None:
        hydra = HydraConfig.get()
        log = os.path.join(hydra.runtime.output_dir, f"{hydra.job.name}.log")
    try:
        with open(log, "a") as f:
            traceback.print_exception(e, file=f)
    except OSError:
        traceback.print_exception(e, file=sys.stderr)
        log = "(not writable: the traceback is above)"
    print(f"[moe_grpo] stopped: {reason}; the run's log: {log}", file=sys.stderr)
    return 1


def closing_line(summary: dict[str, Any], mode: str, run_dir: str) -> str:
    """The last line of a finished run, from `train`'s summary: its steps (a resumed run: how many this process
    took, and in what time), the held-out reward at its start and end, the faults it survived, where its record is."""
    steps, resumed = summary["steps"], summary.get("resumed_from")
    minutes = f"{summary['seconds'] / 60:.1f} min"
    done = (f"{steps} step{'s' * (steps != 1)} in {minutes}" if resumed is None else
            f"{steps} steps, {steps - resumed} of them in {minutes} after resuming at step {resumed}")
    faults = {k: v for k, v in summary["faults"].items() if v}
    start, end = _score(summary["eval_start"]), _score(summary["eval_end"])
    rewards = ("no held-out reward measured" if start == end == "not measured" else
               f"held-out reward {start} at step 0 -> {end} at the end")
    return (f"[moe_grpo] {done} ({mode}); {rewards}; "
            + (f"faults survived: {', '.join(f'{k} {v}' for k, v in faults.items())}; " if faults else "")
            + f"record in {run_dir}")


def _score(value: float | None) -> str:
    """A held-out reward for the last line; NaN or None when none was measured (eval_every=0, no held-out set)."""
    return f"{value:.3f}" if isinstance(value, (int, float)) and math.isfinite(value) else "not measured"


def refuse_taken_run_dir(argv: list[str]) -> None:
    """Exit (code 2) when `hydra.run.dir=` on the command line names a directory that cannot be written (a
    read-only file system), one holding another run's record and `resume=true` is not given, or one whose driver is
    running (`run_dirs.driving`). Runs before Hydra, which writes `.hydra/` into the run directory before `main`: a
    refused run writes nothing. (Parsed with Hydra's own override grammar; `main` checks again on the resolved
    directory.)"""
    overrides = parse_overrides(argv)
    if str(overrides.get("cluster.dry_run", "false")).lower() == "true":
        return  # a dry run writes no record
    run_dir = overrides.get("hydra.run.dir")
    resume = str(overrides.get("resume", "false")).lower() == "true"
    # Hydra's traceback otherwise (a read-only mount: a user's trial, 2026-11-28). Only where the directory is known
    # here: no flags (--help writes nothing, --cfg and -m choose otherwise), no interpolation in the value.
    literal = run_dir if isinstance(run_dir, str) else "outputs"  # conf/config.yaml's default is under outputs/
    if not any(a.startswith("-") for a in argv) and "${" not in literal:
        why = unwritable(literal)
        if why is not None:
            what = f"hydra.run.dir={run_dir}" if isinstance(run_dir, str) else "the run directory (under outputs/)"
            print(f"[moe_grpo] {what} cannot be written: {why}; choose a writable directory", file=sys.stderr)
            sys.exit(2)
    if isinstance(run_dir, str):
        try:
            check_run_dir(os.path.abspath(run_dir), resume)
            if os.path.isdir(run_dir):  # a driver running there: refused before Hydra rewrites its .hydra/ files
                with driving(os.path.abspath(run_dir)):
                    pass
        except RunDirTaken as e:
            print(f"[moe_grpo] {e}", file=sys.stderr)
            sys.exit(2)


def parse_overrides(argv: list[str]) -> dict[str, object]:
    """The command line's overrides by key, parsed with Hydra's own grammar ({} when one is malformed: Hydra reports
    it itself, with its position)."""
    args = [a for a in argv if not a.startswith("-")]
    try:
        return {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(args)}
    except Exception:  # noqa: BLE001
        return {}


def dry_run_dir(argv: list[str]) -> list[str]:
    """`cluster.dry_run=true` without a run directory of its own: Hydra's files go to a temporary directory removed
    at exit, so a dry run leaves nothing under outputs/."""
    overrides = parse_overrides(argv)
    if str(overrides.get("cluster.dry_run", "false")).lower() != "true" or "hydra.run.dir" in overrides:
        return []

    tmp = tempfile.mkdtemp(prefix="moe_grpo-dry-run-")
    atexit.register(shutil.rmtree, tmp, True)
    return [f"hydra.run.dir={tmp}", "hydra.output_subdir=null"]
