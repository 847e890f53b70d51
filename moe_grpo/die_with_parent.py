"""Imported first by the engine core's process server (rollout/engine_core_start.py): the kernel SIGKILLs this
process when the thread that started it ends, which is a thread that lives as long as its process
(PR_SET_PDEATHSIG, Linux). The server then goes with its client at once, however the client ends, even where it
could not act itself (SIGSTOPped) or would take seconds to finalise an interpreter holding vLLM; its children are
tied to it (process_ties) and go with it. Imports nothing; applies no patch."""

from __future__ import annotations

import ctypes
import signal
import sys

if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
