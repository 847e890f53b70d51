"""Readable logs: vLLM, Ray and Megatron chatter at warning level on the console, in full in the run directory.

vLLM configures its loggers from `VLLM_LOGGING_CONFIG_PATH` in every process it
starts (engine core, workers), so one config file written into the run
directory sends INFO and up to `engine.log` there and only warnings to the
console. Set before vLLM is imported (inside the engine actor).
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import warnings
from pathlib import Path


def vllm_logging_config(run_dir: str | Path) -> Path:
    """Write the vLLM logging config for this run; returns its path."""
    path = Path(run_dir) / "vllm_logging.json"
    fmt = "%(asctime)s %(levelname)s [%(process)d %(filename)s:%(lineno)d] %(message)s"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": fmt}},
        "filters": {"known_noise": {"()": "moe_grpo.orchestrator.logs.KnownNoise"}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "level": "WARNING", "formatter": "plain",
                        "stream": "ext://sys.stderr", "filters": ["known_noise"]},
            "file": {"class": "logging.FileHandler", "level": "DEBUG", "formatter": "plain",
                     "filename": str(Path(run_dir).resolve() / "engine.log"), "mode": "a"},
        },
        "loggers": {"vllm": {"level": "INFO", "handlers": ["console", "file"], "propagate": False}},
    }
    path.write_text(json.dumps(config, indent=2))
    return path


class KnownNoise(logging.Filter):
    """Console filter for vLLM warnings that say nothing a user can act on in this setup (kept in engine.log)."""

    PATTERNS = (
        "Failed to load weights",  # partial reloads: the sync loads one decoder layer per call, by design
        "were not loaded from checkpoint",  # the same, listed per call
        "Model Runner V2 requires Triton", "Triton is not installed", "LD_PRELOAD", "Enforce eager set",
        "Inductor compilation was disabled", "Passing raw prompts to InputProcessor",
        "Using None for EOS token id because tokenizer is not initialized",  # we pass stop_token_ids
        "Triton is installed, but doesn't include CPU backend",  # vLLM's CPU build runs without it
        "Reset SSM cache type to float32",  # vLLM's CPU platform, for Mamba layers: our models have none
    )

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(p in msg for p in self.PATTERNS)


def quiet_vllm(run_dir: str | Path) -> None:
    """Route this process's (and its children's) vLLM logs as described above."""
    path = vllm_logging_config(run_dir)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # bars without an explicit `disable` (on GPU: warm-ups, graph capture)
    # Applied here too, before vLLM is imported: vLLM 0.32 applies the file only once an engine's config is built,
    # and what it logs while it is imported went to Python's last-resort handler, past the console's filter
    # (rollout/vllm_logging_early.py does the same in the engine core's process server).
    logging.config.dictConfig(json.loads(path.read_text()))
    # vLLM's CPU communicator reads a pipeline stage's message through torch.frombuffer on a read-only buffer and
    # never writes it (vllm/distributed/device_communicators/cpu_communicator.py:312): a warning on the console of
    # every run with engine pipeline stages, nothing to act on.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning,"
                                            "ignore:The given buffer is not writable:UserWarning")


def quiet_libraries() -> None:
    """Drop the warnings every CPU run of megatron-core and torch repeats and nobody can act on."""
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("megatron").setLevel(logging.WARNING)
