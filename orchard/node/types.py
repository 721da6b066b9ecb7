"""What a caller hands the engine and what it gets back.

Plain dataclasses so they cross Ray and asyncio boundaries unchanged; validation happens
once, in `SamplingParams.__post_init__`, and raises `InvalidSamplingParams` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchard.node.errors import InvalidSamplingParams

if TYPE_CHECKING:
    from orchard.node.constraint import Constraint


#: vLLM's threshold: a temperature this small is greedy decoding.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report per token
    n: int = 1
    priority: int = 0  # lower runs first; ties are first come, first served
    # How many trailing prompt tokens an earlier attempt of this request generated (a resume
    # after a lost node): the sampler counts them as output, so penalties and seeded noise
    # continue as if that attempt had gone on.
    resumed_outputs: int = 0
    # What the output must match (orchard/node/constraint.py); the gateway's dict shape is accepted and compiled here.
    constraint: Constraint | dict[str, Any] | None = None

    def __post_init__(self):
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be between 0 and 100"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be 0 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be between 0 and 20"),
            ("n", 1 <= self.n <= 64, "must be between 1 and 64"),
            ("resumed_outputs", self.resumed_outputs >= 0, "must not be negative"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidSamplingParams(name, why)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise InvalidSamplingParams("stop", "stop strings must not be empty")
        if isinstance(self.constraint, dict):
            from orchard.node.constraint import Constraint  # llguidance loads only once a request asks for a grammar

            self.constraint = Constraint.from_dict(self.constraint)

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW sample the argmax: dividing logits by them overflows float32."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalty(self) -> bool:
        """Penalties read the output so far, so their next token waits for the last one's value."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def reads_outputs(self) -> bool:
        """Penalties and grammars read the output so far: with overlapped steps the last token must settle first."""
        return self.has_penalty or self.constraint is not None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class CompletionOutput:
    """One of a request's `n` continuations; cumulative fields plus the delta of this step."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | int | None = None  # the stop string or token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    node_id: str | None = None  # the node that produced it, set by the backend that streamed it
