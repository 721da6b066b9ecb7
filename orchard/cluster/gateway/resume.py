"""Resuming a stream on another node after its node was lost, so the client sees one stream.

The replayed tokens count as output on the new node (penalties, seeded noise positions,
the token budget), and sampled requests carry a seed from the start, so the continuation
is the one the lost node would have produced.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace

from orchard.node.types import RequestOutput, SamplingParams


@dataclass
class Progress:
    """What the client has received so far for one request, and where this attempt began.

    Token ids and text are tracked for n = 1, the only case that resumes mid-stream; for
    n > 1 it only records that something was streamed, which makes a resume impossible.
    """

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    base_ids: list[int] = field(default_factory=list)  # streamed before the current attempt
    base_text: str = ""
    unsent_text: str = ""  # text of base_ids the client has not seen yet; goes out first
    streamed: bool = False  # any choice has produced a token

    def record(self, out: RequestOutput) -> None:
        self.streamed = self.streamed or any(c.token_ids for c in out.outputs)
        if len(out.outputs) == 1:
            self.token_ids = list(out.outputs[0].token_ids)
            self.text = out.outputs[0].text

    def resume(self, tokenizer) -> None:
        self.unsent_text = held_back_text(tokenizer, self.token_ids, self.text)
        self.base_ids = list(self.token_ids)
        self.base_text = self.text + self.unsent_text


def seeded(params: SamplingParams) -> SamplingParams:
    """Sampled requests get a seed here if they have none, so that a resume on another node
    draws the same noise the lost one would have (the sampler keys it by seed and position)."""
    if params.seed is not None or params.greedy:
        return params
    return replace(params, seed=secrets.randbits(62))


def resume_params(params: SamplingParams, streamed: int) -> SamplingParams:
    """An attempt that replays `streamed` generated tokens as prompt: they count as output
    (penalties, noise positions, the token budget), so the continuation is the one the lost
    node would have produced."""
    if not streamed:
        return params
    return replace(params, max_tokens=params.max_tokens - streamed, resumed_outputs=streamed)


def held_back_text(tokenizer, token_ids: list[int], sent_text: str) -> str:
    """Text of streamed tokens the client has not seen yet (held back while a stop string could match)."""
    if tokenizer is None or not token_ids:
        return ""
    full = tokenizer.decode(token_ids)
    return full[len(sent_text):] if full.startswith(sent_text) else ""
