"""Prompts given as chat messages (`[{"role": "user", "content": "..."}]`), as TRL's and verl's datasets give them.

A checkpoint's chat template renders them (data/tokenizer.py `HFTokenizer.encode_prompt`); the reward functions
get the messages as the row's prompt. A message is an object with a non-empty text `role` and a text `content`;
anything else makes the row a bad row, named by the message (counting from 1).
"""

from __future__ import annotations

from typing import Any

KINDS = {list: "a list", dict: "an object", bool: "true/false", str: "text"}


def kind(value: Any) -> str:
    """What a value is, in a message's words."""
    return "null" if value is None else KINDS.get(type(value), "a number")


def message_problem(messages: list[Any]) -> str | None:
    """Why `messages` is not a conversation the chat template can render, or None."""
    for i, m in enumerate(messages, start=1):
        if not isinstance(m, dict):
            return f"message {i} is {kind(m)}, expected an object with 'role' and 'content'"
        for key in ("role", "content"):
            if key not in m:
                return f"message {i} has no {key!r}"
            if not isinstance(m[key], str):
                parts = " (a list of parts: join their text into one string)" if isinstance(m[key], list) else ""
                return f"message {i}'s {key!r} is {kind(m[key])}, expected text{parts}"
        if not m["role"].strip():
            return f"message {i}'s 'role' is empty"
    if not any(m["content"].strip() for m in messages):
        return "no message has any text"
    return None


class MessageDropped(ValueError):
    """The chat template rendered a conversation without one of its messages' text (e.g. Qwen's template skips a
    role it does not know, such as ShareGPT's "human"): the prompt would be the generation prompt alone."""


def check_rendered(messages: list[dict[str, str]], rendered: str) -> None:
    """Raise `MessageDropped` when a message's text (other than an assistant turn's, which templates may rewrite,
    e.g. drop its reasoning) is not in what the template rendered."""
    for i, m in enumerate(messages, start=1):
        text = m["content"].strip()
        if text and m["role"] != "assistant" and text not in rendered:
            raise MessageDropped(f"message {i} (role {m['role']!r}) is not in the rendered prompt: the chat "
                                 "template dropped it (a role it does not know?)")


def without_nulls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without their keys whose value is null: Parquet stores a file's messages as one struct type, so a
    key one message has (`tool_calls`) is null in all the others, and a template that tests for the key (`{% if
    'tool_calls' in m %}`) then iterates None and refuses every row (a user's trial, 2026-11-28)."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]
