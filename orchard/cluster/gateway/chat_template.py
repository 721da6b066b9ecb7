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

Tools, the calls of earlier assistant turns and `chat_template_kwargs` reach the template
as themselves (that is where templates lay them out), so their text may hold no control
token either. Without a template, ChatML presents tools the Hermes way (a `<tools>` block
in the system turn, calls as `<tool_call>` JSON, results as `<tool_response>`), which the
`hermes` parser reads back.
"""

from __future__ import annotations

import json
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


def render_chatml(messages: list[dict], tools: list[dict] | None = None) -> str:
    messages = _with_tools_turn(messages, tools) if tools else messages
    turns = "".join(f"<|im_start|>{m['role']}\n{_chatml_body(m)}{CHATML_END}\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _with_tools_turn(messages: list[dict], tools: list[dict]) -> list[dict]:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = (f"# Tools\n\nYou may call one or more functions. Their signatures are within <tools></tools>:\n"
            f"<tools>\n{listing}\n</tools>\n\nFor each call, answer a JSON object with the function's name and "
            f"arguments within <tool_call></tool_call>:\n<tool_call>\n{{\"name\": <name>, \"arguments\": <object>}}\n"
            f"</tool_call>")
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "tools_text": text}, *messages[1:]]
    return [{"role": "system", "content": "", "tools_text": text}, *messages]


def _chatml_body(m: dict) -> str:
    body = m["content"]
    if m.get("tools_text"):
        body = f"{body}\n\n{m['tools_text']}" if body else m["tools_text"]
    for call in m.get("tool_calls") or []:
        fn = call["function"]
        body += f"\n<tool_call>\n{json.dumps({'name': fn['name'], 'arguments': fn['arguments']}, ensure_ascii=False)}\n</tool_call>"
    if m["role"] == "tool":
        body = f"<tool_response>\n{body}\n</tool_response>"
    return body


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else None


def _placeholder(i: int) -> str:
    return f"\ue000orchard-content-{i}\ue001"  # private-use characters: no template or user writes them


_PLACEHOLDER = re.compile("\ue000orchard-content-(\\d+)\ue001")


def _render_template(tokenizer: Any, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
    extra = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra, **kwargs)
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


def _checked_contents(tokenizer: Any, messages: list[dict]) -> None:
    markers = control_token_texts(tokenizer)
    for m in messages:
        for marker in markers:
            if marker in m["content"]:
                raise ChatTemplateError(f"message content may not contain the model's control token {marker!r}")


def _checked_layout(tokenizer: Any, what: str, value: Any) -> None:
    """Text the template lays out itself (tools, earlier calls, template variables) may hold no control token."""
    if not value:
        return
    text = json.dumps(value, ensure_ascii=False)
    for marker in control_token_texts(tokenizer):
        if marker in text or json.dumps(marker)[1:-1] in text:
            raise ChatTemplateError(f"{what} may not contain the model's control token {marker!r}")


def _masked(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """Messages with each non-empty content replaced by a numbered placeholder (an empty one
    stays empty: templates test `if message.content`), and those contents in order."""
    contents: list[str] = []
    masked = []
    for m in messages:
        if m["content"]:
            masked.append({**m, "content": _placeholder(len(contents))})
            contents.append(m["content"])
        else:
            masked.append(m)
    return masked, contents


def build_chat_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                      template_kwargs: dict | None = None) -> ChatPrompt:
    """Token ids for `messages` (dicts with role and content, and the template's other keys:
    tool_calls, tool_call_id, name, reasoning_content) plus the turn's stop markers."""
    for m in messages:
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (JSON's "\ud800") has no UTF-8 form
            raise InvalidContent(f"message content is not valid Unicode: {exc.reason} at position {exc.start}") from exc
    kwargs = dict(template_kwargs or {})
    _checked_layout(tokenizer, "tools", tools)
    _checked_layout(tokenizer, "chat_template_kwargs", kwargs)
    _checked_layout(tokenizer, "tool_calls", [m.get("tool_calls") for m in messages if m.get("tool_calls")])
    masked, contents = _masked(messages)
    if has_template(tokenizer):
        ids = _encode_pieces(tokenizer, _render_template(tokenizer, masked, tools, kwargs), contents)
        if ids is None:
            _checked_contents(tokenizer, messages)
            rendered = _render_template(tokenizer, messages, tools, kwargs)
            ids = [int(t) for t in tokenizer.encode(rendered, add_special_tokens=False)]
        return ChatPrompt(ids)
    before, after = _around(tokenizer)
    ids = before + (_encode_pieces(tokenizer, render_chatml(masked, tools), contents) or []) + after
    end_id = _single_token_id(tokenizer, CHATML_END)
    return ChatPrompt(ids, stop=[CHATML_END], stop_token_ids=[end_id] if end_id is not None else [])
