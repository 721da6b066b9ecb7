"""Reasoning parsers: a thinking model's text split into its reasoning and the rest.

Qwen3, DeepSeek-R1 and their kin think between `<think>` and `</think>`; a template may
open the block itself (the prompt then ends in `<think>`), so the model's text starts
inside it. gpt-oss thinks in harmony's `analysis` channel. Like the tool parsers, a parser
answers again as the text grows and its answers only grow, so reasoning streams as deltas;
trailing whitespace of the reasoning is held until more text shows it is not the end.

Names are vLLM's (`--reasoning-parser`); without the flag, the model's template picks one.
"""

from __future__ import annotations

from orchard.cluster.gateway.tool_parsers import harmony
from orchard.cluster.gateway.tool_parsers.base import held_back

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    needs_special_tokens = False

    def split(self, text: str, final: bool, prompt_text: str) -> tuple[str, str]:
        """(reasoning, rest) of `text`, the model's answer to a prompt ending in `prompt_text`."""
        raise NotImplementedError


class ThinkParser(ReasoningParser):
    """`<think>...</think>`; text before `</think>` is reasoning when the prompt opened the block."""

    name = "qwen3"

    def split(self, text: str, final: bool, prompt_text: str) -> tuple[str, str]:
        opened = prompt_text.rstrip().endswith(THINK_START)
        start = len(text) - len(text.lstrip())
        if not opened:
            if text.startswith(THINK_START, start):
                start += len(THINK_START)
            elif not final and THINK_START.startswith(text[start:]):
                return "", ""  # perhaps the opening marker, still arriving
            else:
                return "", text
        end = text.find(THINK_END, start)
        if end < 0:
            thought = held_back(text[start:], (THINK_END,), final)
            return (thought.strip() if final else thought.lstrip().rstrip()), ""
        return text[start:end].strip(), text[end + len(THINK_END):].lstrip()


class DeepSeekR1Parser(ThinkParser):
    name = "deepseek_r1"


class HarmonyReasoning(ReasoningParser):
    name = "openai_gptoss"
    needs_special_tokens = True

    def split(self, text: str, final: bool, prompt_text: str) -> tuple[str, str]:
        return harmony.reasoning_of(text, final), text  # the rest keeps its channels for the content


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": ThinkParser,
    "deepseek_r1": DeepSeekR1Parser,
    "openai_gptoss": HarmonyReasoning,
}


def reasoning_parser_named(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}") from None


def detect_reasoning(template: str | None) -> str | None:
    if template is None:
        return None
    if "<|channel|>" in template:
        return "openai_gptoss"
    if THINK_END in template:
        return "deepseek_r1" if "deepseek" in template.lower() else "qwen3"
    return None
