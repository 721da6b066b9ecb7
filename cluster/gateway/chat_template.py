"""Chat messages to prompt token ids: the model's own template, else plain ChatML.

Models without a template (the demo model among them) still need a stable, documented
layout so chat works and prefix caching sees the same tokens for the same conversation;
ChatML is the common one. Generation then stops at ChatML's end-of-turn marker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHATML_END = "<|im_end|>"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's template (e.g. roles out of order)."""


@dataclass
class ChatPrompt:
    token_ids: list[int]
    stop: list[str] = field(default_factory=list)  # stop strings the layout itself implies
    stop_token_ids: list[int] = field(default_factory=list)


def has_template(tokenizer: Any) -> bool:
    flag = getattr(tokenizer, "has_chat_template", None)
    if flag is not None:
        return bool(flag)
    return getattr(tokenizer, "chat_template", None) is not None


def render_chatml(messages: list[dict[str, str]]) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}{CHATML_END}\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else None


def build_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> ChatPrompt:
    """Token ids for `messages` (dicts with role and content) plus the turn's stop markers."""
    if has_template(tokenizer):
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # a template raises whatever jinja or its author chose
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return ChatPrompt([int(t) for t in ids])
    ids = list(tokenizer.encode(render_chatml(messages)))
    end_id = _single_token_id(tokenizer, CHATML_END)
    return ChatPrompt(ids, stop=[CHATML_END], stop_token_ids=[end_id] if end_id is not None else [])
