"""Synthetic workloads: what each benchmark request asks for.

Every workload is a stream of conversations. Single-turn datasets (`random`,
`prefix-repetition`) yield one-turn conversations; `multi-turn` yields conversations
whose later turns resend the whole history, so the context grows and a server with a
prefix cache can reuse it. Generation is lazy and seeded: the same seed gives the same
requests, which is what makes two servers comparable.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from orchard.cluster.bench.loadgen.prompts import LengthRange, PromptSource

DATASETS = ("random", "prefix-repetition", "multi-turn")
APIS = ("completions", "chat")


class UnknownDataset(ValueError):
    """The dataset name is not one this benchmark generates."""


@dataclass(frozen=True)
class Turn:
    """One user message and the output budget of the reply to it."""

    text: str
    input_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after another; `chat` selects /v1/chat/completions."""

    id: int
    turns: tuple[Turn, ...]
    chat: bool


@dataclass(frozen=True)
class DatasetConfig:
    """Shape of the synthetic workload; lengths in tokens (approximate without a tokenizer)."""

    name: str = "random"
    input_len: LengthRange = field(default_factory=lambda: LengthRange(128))
    output_len: LengthRange = field(default_factory=lambda: LengthRange(32))
    num_prefixes: int = 4
    prefix_len: int = 256
    turns: int = 4
    api: str = "completions"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise UnknownDataset(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        if self.api not in APIS:
            raise ValueError(f"unknown api {self.api!r}; choose one of {', '.join(APIS)}")
        if self.num_prefixes < 1 or self.prefix_len < 1 or self.turns < 1:
            raise ValueError("num_prefixes, prefix_len and turns must each be at least 1")

    @property
    def uses_chat(self) -> bool:
        return self.api == "chat" or self.name == "multi-turn"


def conversations(cfg: DatasetConfig, source: PromptSource, max_requests: int) -> Iterator[Conversation]:
    """Conversations holding `max_requests` turns in all (the last one may be cut short)."""
    rng = random.Random(cfg.seed)
    make_turn = _turn_maker(cfg, source, rng)
    turns_per = cfg.turns if cfg.name == "multi-turn" else 1
    issued = 0
    for conv_id in range(max_requests):
        if issued >= max_requests:
            return
        n = min(turns_per, max_requests - issued)
        issued += n
        yield Conversation(id=conv_id, turns=tuple(make_turn() for _ in range(n)), chat=cfg.uses_chat)


def _turn_maker(cfg: DatasetConfig, source: PromptSource, rng: random.Random):
    if cfg.name == "prefix-repetition":
        prefixes = [source.text(cfg.prefix_len, rng) for _ in range(cfg.num_prefixes)]
        return lambda: _prefixed_turn(cfg, source, rng, rng.choice(prefixes))
    return lambda: _plain_turn(cfg, source, rng)


def _plain_turn(cfg: DatasetConfig, source: PromptSource, rng: random.Random) -> Turn:
    text = source.text(cfg.input_len.draw(rng), rng)
    return Turn(text=text, input_tokens=source.count(text), max_tokens=cfg.output_len.draw(rng))


def _prefixed_turn(cfg: DatasetConfig, source: PromptSource, rng: random.Random, prefix: str) -> Turn:
    text = prefix + " " + source.text(cfg.input_len.draw(rng), rng)
    return Turn(text=text, input_tokens=source.count(text), max_tokens=cfg.output_len.draw(rng))
