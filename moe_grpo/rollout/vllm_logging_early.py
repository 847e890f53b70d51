"""vLLM's logging config applied when this module is imported, before vLLM is: what vLLM logs while it is imported
reaches the run's handlers, not Python's last-resort one.

vLLM 0.32 applies the config file named by `VLLM_LOGGING_CONFIG_PATH` (orchestrator/logs.py writes it into the run
directory) only once an engine's config is built (`vllm.logger.configure_logging`). A warning logged while vLLM is
imported ("Triton is installed, but doesn't include CPU backend", twice: the engine actor's import and its engine-core
server's) found no handler and went to Python's last-resort one: a bare line on every run's console, past the
console's filter and missing from `engine.log`. vLLM later applies the same file again, which changes nothing.
The engine actor applies its config itself (`orchestrator.logs.quiet_vllm`); this module is what the engine core's
process server imports before vLLM (rollout/engine_core_start.py: a server can only import), and applies it there.
Only the standard library; it never raises (a file it cannot apply is vLLM's to report when it applies it).
"""

from __future__ import annotations

import json
import logging.config
import os


def apply_from_env() -> bool:
    """Apply the dict config at `VLLM_LOGGING_CONFIG_PATH`, if set and readable; returns whether it was applied."""
    path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if not path or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return False
    try:
        with open(path) as f:
            logging.config.dictConfig(json.load(f))
    except Exception:  # noqa: BLE001 - a stale or bad file: vLLM reports it itself when it applies it
        return False
    return True


apply_from_env()
