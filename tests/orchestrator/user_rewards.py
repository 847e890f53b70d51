"""Reward functions a user would write, named by dotted path in the tests (`user_rewards:...`)."""

import asyncio
import json
import math
import os


def length_penalty(prompts, completions, **fields):
    """Records the row fields it was given (to $USER_REWARD_LOG); raises on rows marked trap=raise, returns NaN
    for the first sample of rows marked trap=nan, else a small penalty on long completions."""
    log = os.environ.get("USER_REWARD_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"prompts": prompts, "fields": fields}) + "\n")
    if any(t == "raise" for t in fields.get("trap", [])):
        raise RuntimeError("this row's reward raises on purpose")
    out = [-0.01 * len(c) for c in completions]
    if any(t == "nan" for t in fields.get("trap", [])):
        out[0] = math.nan
    return out


def only_answer(prompts, completions, answer):
    """Names only `answer`: gets no other field."""
    return [float(len(a) > 0) for a in answer]


async def async_constant(prompts, completions, **fields):
    await asyncio.sleep(0)
    return [0.5] * len(completions)


async def async_sleeps(prompts, completions, **fields):
    await asyncio.sleep(30)
    return [0.0] * len(completions)


def sleeps(prompts, completions, **fields):
    import time

    time.sleep(30)
    return [0.0] * len(completions)


def wrong_length(prompts, completions, **fields):
    return [1.0]


def returns_labels(prompts, completions, **fields):
    return ["good"] * len(completions)


def returns_number_strings(prompts, completions, **fields):
    return ["0.5"] * len(completions)


not_a_function = 3
