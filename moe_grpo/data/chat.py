"""Prompts given as chat messages (`[{"role": "user", "content": "..."}]`), as TRL's and verl's datasets give them.

A checkpoint's chat template renders them (data/tokenizer.py `HFTokenizer.encode_prompt`); the reward functions
get the messages as the row's prompt. A message is an object with a non-empty text `role` and a `content` that is
text or a list of text parts (`[{"type": "text", "text": "..."}]`, OpenAI's and TRL's multimodal layout, joined
with newlines as vLLM joins them for a text model: `as_text`); anything else makes the row a bad row, named by the
message (counting from 1).
"""

from __future__ import annotations

from typing import Any

KINDS = {list: "a list", dict: "an object", bool: "true/false", str: "text"}


def kind(value: Any) -> str:
    """What a value is, in a message's words."""
    return "null" if value is None else KINDS.get(type(value), "a number")


def parts_problem(parts: list[Any]) -> str | None:
    """Why a message's list of content parts is not text alone, or None."""
    for j, part in enumerate(parts, start=1):
        if not isinstance(part, dict):
            return f"part {j} is {kind(part)}, expected an object with 'type' and 'text'"
        if part.get("type") != "text":
            return f"part {j} is of type {part.get('type')!r}: a text model takes text parts only"
        if not isinstance(part.get("text"), str):
            return f"part {j}'s 'text' is {kind(part.get('text'))}, expected text"
    return None


def content_text(content: str | list[dict[str, Any]]) -> str:
    """A message's content as text: its text parts joined with newlines (what vLLM does for a text model)."""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


def as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each content given as parts turned into text (`content_text`), the rest as they are."""
    return [{**m, "content": content_text(m["content"])} if isinstance(m.get("content"), list) else m
            for m in messages]


def message_problem(messages: list[Any]) -> str | None:
    """Why `messages` is not a conversation the chat template can render, or None."""
    for i, m in enumerate(messages, start=1):
        if not isinstance(m, dict):
            return f"message {i} is {kind(m)}, expected an object with 'role' and 'content'"
        for key in ("role", "content"):
            if key not in m:
                return f"message {i} has no {key!r}"
        if not isinstance(m["role"], str):
            return f"message {i}'s 'role' is {kind(m['role'])}, expected text"
        if isinstance(m["content"], list):
            problem = parts_problem(m["content"])
            if problem:
                return f"message {i}'s 'content' {problem}"
        elif not isinstance(m["content"], str):
            return f"message {i}'s 'content' is {kind(m['content'])}, expected text or a list of text parts"
        if not m["role"].strip():
            return f"message {i}'s 'role' is empty"
    if not any(content_text(m["content"]).strip() for m in messages):
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
