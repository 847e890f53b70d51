"""Whether a local process still runs: what the engine and the driver check when a child or an actor may have died
without the library in between (vLLM, Ray) noticing."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """False once the process has exited, including as a not yet reaped zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
