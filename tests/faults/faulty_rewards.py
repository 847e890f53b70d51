"""A reward function that hangs on chosen calls (the built-in task's reward otherwise)."""

import os
import time

from moe_grpo.data.tasks import score

CUES_ENV = "FAULTY_REWARDS_CUES"
"""The folder `hang_on_cue` reads its cues from (the test that starts the run names it in the run's environment)."""

_calls = 0


def hang_on_cue(prompts, completions, answer, **kwargs):
    """Hangs on every third call of its worker while the folder `$FAULTY_REWARDS_CUES` holds a file `every_third`;
    once the test removes it, a call hangs only when it takes a cue (removes a file `hang-*` there, one call per
    file), so that the test places each later hang where it wants one (at an engine fault) and a step without one
    costs no reward timeout."""
    global _calls
    _calls += 1
    cues = os.environ[CUES_ENV]
    if os.path.exists(os.path.join(cues, "every_third")):
        hang = _calls % 3 == 0
    else:
        hang = any(_take(os.path.join(cues, name)) for name in sorted(os.listdir(cues)) if name.startswith("hang-"))
    if hang:
        time.sleep(3600)
    return score(prompts, completions, answer)


def _take(path: str) -> bool:
    """Whether this call removed the cue (another worker may take it first)."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
