"""gpt-oss's harmony format: the answer is a run of messages, each a header and a body.

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

`analysis` bodies are reasoning (`reasoning.py` reads them), `final` bodies and commentary
without a recipient are content, and commentary addressed `to=functions.NAME` is a call.
Every marker is a special token, so this reads text decoded with them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from orchard.cluster.gateway.tool_parsers.base import CallScan, Scan, ToolParser, held_back

MESSAGE, START = "<|message|>", "<|start|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    body: str
    complete: bool


def split_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of `text` so far; a body still arriving holds back a partial terminator."""
    out: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        m = text.find(MESSAGE, pos)
        if m < 0:
            break  # a header still arriving
        header = text[pos:m]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        start = m + len(MESSAGE)
        ends = [(text.find(t, start), t) for t in TERMINATORS]
        ends = [(i, t) for i, t in ends if i >= 0]
        if not ends:
            body = held_back(text[start:], TERMINATORS, final)
            out.append(HarmonyMessage(channel and channel.group(1), recipient and recipient.group(1), body, final))
            break
        end, term = min(ends)
        out.append(HarmonyMessage(channel and channel.group(1), recipient and recipient.group(1), text[start:end], True))
        pos = end + len(term)
        if text.startswith(START, pos):
            pos += len(START)
    return out


def reasoning_of(text: str, final: bool) -> str:
    return "".join(m.body for m in split_messages(text, final) if m.channel == "analysis")


def content_of(text: str, final: bool) -> str:
    return "".join(m.body for m in split_messages(text, final) if m.channel != "analysis" and not m.recipient)


class HarmonyParser(ToolParser):
    name = "openai"
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        scan = Scan()
        for m in split_messages(text, final):
            if m.channel == "analysis":
                continue
            if m.recipient and m.recipient.startswith("functions."):
                scan.calls.append(CallScan(name=m.recipient[len("functions."):], arguments=m.body, complete=m.complete))
            elif not scan.calls:
                scan.content += m.body
        return scan
