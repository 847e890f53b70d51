"""The root cause of a vLLM failure, read from the log its processes write.

vLLM 0.32's client says only "Engine core initialization failed. See root cause above." when an engine core or one
of its workers fails to start: the cause (a KV cache larger than the host's memory, a bad checkpoint, ...) is logged
by the process that hit it. A run's vLLM processes log to one file (`orchestrator/logs.py` writes the logging config
vLLM reads from `VLLM_LOGGING_CONFIG_PATH`), so the engine reads it back from there, from where the file ended when
its start began.
"""

from __future__ import annotations

import json
import os
import re

EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?:: \S.*)?$")
"""The last line of a Python traceback: `ValueError: ...`, `torch.OutOfMemoryError: ...`, a bare `AssertionError`."""
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
"""The first line of a log record (orchestrator/logs.py's format starts with the time); a traceback follows it."""
MAX_READ = 4 << 20
MAX_CAUSE_CHARS = 600


def vllm_log_file() -> str | None:
    """The file vLLM's processes log to: the first file handler of the logging config vLLM reads
    (`VLLM_LOGGING_CONFIG_PATH`), or None without one (vLLM then logs to stderr only)."""
    config_path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if not config_path:
        return None
    try:
        with open(config_path) as f:
            handlers = json.load(f).get("handlers", {})
    except (OSError, ValueError, AttributeError):
        return None
    files = [h["filename"] for h in handlers.values() if isinstance(h, dict) and h.get("filename")]
    return files[0] if files else None


def log_size(log_file: str | None) -> int:
    """Where `log_file` ends now (0 if it does not exist yet)."""
    try:
        return os.path.getsize(log_file) if log_file else 0
    except OSError:
        return 0


def root_cause(log_file: str | None, since: int) -> str | None:
    """The exception of the first error record vLLM logged in `log_file` after byte `since` with a traceback, in one
    line (None: none, or no file). The first is the cause: the engine core's and the client's errors that follow only
    say a worker or the core failed. The file is the run's: with several engines starting at once it may be
    another's (their cause is then usually the same setting)."""
    if not log_file:
        return None
    try:
        with open(log_file, "rb") as f:
            f.seek(since)
            text = f.read(MAX_READ).decode(errors="replace")
    except OSError:
        return None
    in_error = False  # inside an ERROR record (its first line and the traceback below it)
    for line in text.splitlines():
        if RECORD_START.match(line):
            in_error = " ERROR " in line or " CRITICAL " in line
        elif in_error and EXCEPTION_LINE.match(line):
            cause = line.strip()
            return cause if len(cause) <= MAX_CAUSE_CHARS else cause[:MAX_CAUSE_CHARS] + " ..."
    return None
