"""Chat messages to prompt token ids: the model's own template, else plain ChatML.

Models without a template (the demo model among them) still need a stable, documented
layout so chat works and prefix caching sees the same tokens for the same conversation;
ChatML is the common one. Generation then stops at ChatML's end-of-turn marker.

Only the layout's own markers become control tokens: the text is rendered with a
placeholder for each message's content, the layout is tokenized as usual and each content
as plain text (`split_special_tokens`), so a user who writes `<|im_end|>` gets the
characters, not the end of their turn. A template that does not keep the placeholders as
they are (one that inspects or rewrites the content) renders the real text instead, and
content that holds a control token's text is then refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

CHATML_END = "<|im_end|>"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's template (e.g. roles out of order)."""


class InvalidContent(ChatTemplateError):
    """A message's content cannot be tokenized at all (text that is not valid Unicode)."""


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


def _placeholder(i: int) -> str:
    return f"\ue000orchard-content-{i}\ue001"  # private-use characters: no template or user writes them


_PLACEHOLDER = re.compile("\ue000orchard-content-(\\d+)\ue001")


def _render_template(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # a template raises whatever jinja or its author chose
        raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from exc


def control_token_texts(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into special (control) tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = [str(getattr(t, "content", t)) for t in added.values() if getattr(t, "special", True)]
    texts += [str(t) for t in getattr(tokenizer, "all_special_tokens", None) or []]
    return sorted({t for t in texts if t})


def _plain(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)]


def _around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """What `encode` adds around a text by itself (a BOS, for some tokenizers)."""
    bare = [int(t) for t in tokenizer.encode("a", add_special_tokens=False)]
    full = [int(t) for t in tokenizer.encode("a")]
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    return [], []


def _encode_pieces(tokenizer: Any, rendered: str, contents: list[str]) -> list[int] | None:
    """Token ids of `rendered`, where only the layout's control-token texts are control
    tokens and each placeholder's content is plain text; None when the placeholders are not
    each there exactly once and in order.

    Text between two control tokens is tokenized in one piece, layout and content together,
    as when the whole text is tokenized at once: a conversation without markers in its
    content gets the same ids either way."""
    pieces = _PLACEHOLDER.split(rendered)
    if [int(i) for i in pieces[1::2]] != list(range(len(contents))):
        return None
    markers = control_token_texts(tokenizer)
    marker_re = re.compile("(" + "|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)) + ")") if markers else None
    ids: list[int] = []
    stretch: list[str] = []

    def flush() -> None:
        if stretch:
            ids.extend(_plain(tokenizer, "".join(stretch)))
            stretch.clear()

    for k, piece in enumerate(pieces):
        if k % 2:
            stretch.append(contents[int(piece)])
            continue
        for j, part in enumerate(marker_re.split(piece) if marker_re else [piece]):
            if j % 2:
                flush()
                ids.extend(int(t) for t in tokenizer.encode(part, add_special_tokens=False))
            elif part:
                stretch.append(part)
    flush()
    return ids


def _checked_contents(tokenizer: Any, messages: list[dict[str, str]]) -> None:
    markers = control_token_texts(tokenizer)
    for m in messages:
        for marker in markers:
            if marker in m["content"]:
                raise ChatTemplateError(f"message content may not contain the model's control token {marker!r}")


def build_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> ChatPrompt:
    """Token ids for `messages` (dicts with role and content) plus the turn's stop markers."""
    contents = [m["content"] for m in messages]
    for text in contents:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (JSON's "\ud800") has no UTF-8 form
            raise InvalidContent(f"message content is not valid Unicode: {exc.reason} at position {exc.start}") from exc
    masked = [{**m, "content": _placeholder(i)} for i, m in enumerate(messages)]
    if has_template(tokenizer):
        ids = _encode_pieces(tokenizer, _render_template(tokenizer, masked), contents)
        if ids is None:
            _checked_contents(tokenizer, messages)
            rendered = _render_template(tokenizer, messages)
            ids = [int(t) for t in tokenizer.encode(rendered, add_special_tokens=False)]
        return ChatPrompt(ids)
    before, after = _around(tokenizer)
    ids = before + (_encode_pieces(tokenizer, render_chatml(masked), contents) or []) + after
    end_id = _single_token_id(tokenizer, CHATML_END)
    return ChatPrompt(ids, stop=[CHATML_END], stop_token_ids=[end_id] if end_id is not None else [])
