"""A reward function that hangs on every third call of its worker (the built-in task's reward otherwise)."""

import time

from moe_grpo.data.tasks import score

_calls = 0


def hang_every_third(prompts, completions, answer, **kwargs):
    global _calls
    _calls += 1
    if _calls % 3 == 0:
        time.sleep(3600)
    return score(prompts, completions, answer)
