"""Range checks the config sections share, each raising one message shape: `<key>=<value!r>: expected <what>`;
and `InputRefused`, a run's inputs that cannot be used.

Types are checked before a section sees its values (config.py `checked_types`), so these assume numbers; they
still refuse NaN and infinity themselves because a dataclass may also be built directly in code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import typing
from typing import Any, Iterator, Mapping


class InputRefused(ValueError):
    """A run's inputs cannot be used: a data file missing, empty or without a usable row, a prompt longer than the
    engines' context, a reward function's dotted path that does not import. The entry points report it in one line
    with exit status 2, as a config error, before any process starts."""


@contextlib.contextmanager
def refused_inputs() -> Iterator[None]:
    """Around reading the data, measuring the prompts and importing the reward functions: what they raise about
    their inputs (OSError, ValueError, ImportError; their messages name the file and row, or the dotted path)
    becomes `InputRefused`. Other errors (a TypeError, an AttributeError) are bugs, not inputs: they go on with
    their traceback."""
    try:
        yield
    except InputRefused:
        raise
    except (OSError, ValueError, ImportError) as e:
        raise InputRefused(str(e)) from e


def refuse(key: str, value: Any, expected: str) -> ValueError:
    """The error every check raises: the key (with its section), the value as written and what was expected."""
    return ValueError(f"{key}={value!r}: expected {expected}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive(key: str, value: Any) -> None:
    """A finite number > 0 (timeouts, learning rates, widths)."""
    if not (_finite(value) and value > 0):
        raise refuse(key, value, "a number > 0")


def non_negative(key: str, value: Any) -> None:
    """A finite number >= 0 (coefficients where 0 turns the term off, resources, penalties)."""
    if not (_finite(value) and value >= 0):
        raise refuse(key, value, "a number >= 0")


def at_least(key: str, value: Any, low: int, note: str = "") -> None:
    """An integer >= `low` (counts); `note` says what the smallest values mean, e.g. '(0 = off)'."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise refuse(key, value, f"an integer >= {low}" + (f" {note}" if note else ""))


def optional_at_least(key: str, value: Any, low: int) -> None:
    """None, or an integer >= `low`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise refuse(key, value, f"an integer >= {low} or null")


def between(key: str, value: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> None:
    """A finite number in [low, high]; `low_open` / `high_open` exclude that end (e.g. 0 < top_p <= 1)."""
    ok = _finite(value) and (value > low if low_open else value >= low) and (value < high if high_open else
                                                                             value <= high)
    if not ok:
        raise refuse(key, value, f"a number {'>' if low_open else '>='} {low:g} and {'<' if high_open else '<='} {high:g}")


def unknown_key(key: str, keys: Mapping[str, Any], renamed: Mapping[str, str] | None = None) -> str | None:
    """Why the command line's dotted `key` names nothing in `keys`, or None when it does: a message naming it, the
    nearest known key (difflib) and the section's keys. `keys` maps a name to None (a plain field), to its section's
    field names, or to its section's own mapping of this shape (`logger.wandb.mode`). `renamed` maps keys of older
    configs to what to write instead. Below a plain field (a list's index, `model.extra_hf_config.<key>`) is left to
    the conversion."""
    if renamed and key in renamed:
        return renamed[key]
    level: Any = keys
    parts = key.split(".")
    for depth, name in enumerate(parts):
        if level is None:  # below a plain field
            return None
        if name not in level:
            if depth == 0:
                return _no_such_key(key, name, "", level) + "; `--help` lists every key"
            section = ".".join(parts[:depth])
            return _no_such_key(key, name, f"{section}.", level) + f"; {section}'s keys: {', '.join(sorted(level))}"
        level = level[name] if isinstance(level, Mapping) else None
    return None


def dataclass_keys(cls: type) -> dict[str, Any]:
    """`unknown_key`'s shape of a config dataclass: each field's name -> None, or for a field that is a dataclass
    itself, that one's keys."""
    hints = typing.get_type_hints(cls)
    return {f.name: dataclass_keys(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else None
            for f in dataclasses.fields(cls)}


def _no_such_key(key: str, name: str, prefix: str, known: Any) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"unknown key {key}" + (f" (did you mean {prefix}{close[0]}?)" if close else "")
