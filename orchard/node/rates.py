"""Moving averages of what the node measures about itself, for routing and preemption.

Routing and migrate-or-recompute decisions compare measured rates, never constants:
these are exponentially weighted so they follow load changes within a few steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ewma:
    alpha: float = 0.2
    value: float | None = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.alpha * sample + (1 - self.alpha) * self.value
        return self.value

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


#: Steps a node runs before its rates count: the first compiles kernels and faults weights in,
#: and a rate taken from it made a cold node look several times slower than it is.
WARMUP_STEPS = 1


@dataclass
class WeightedLine:
    """`y = fixed + slope x`, least squares over exponentially weighted moments of recent samples,
    so the line follows what it measures as that changes. A slope counts only where samples of
    different sizes show one with a fixed part >= 0: one size alone cannot split the two."""

    alpha: float = 0.2
    samples: int = 0
    mean_x: float = 0.0
    mean_y: float = 0.0
    mean_xx: float = 0.0
    mean_xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        w = 1.0 if self.samples == 0 else self.alpha
        self.mean_x += w * (x - self.mean_x)
        self.mean_y += w * (y - self.mean_y)
        self.mean_xx += w * (x * x - self.mean_xx)
        self.mean_xy += w * (x * y - self.mean_xy)
        self.samples += 1

    def slope(self) -> float | None:
        """The line's slope, or None until samples of different sizes gave one with a fixed part >= 0."""
        spread = self.mean_xx - self.mean_x**2
        covariance = self.mean_xy - self.mean_x * self.mean_y
        if spread <= (0.05 * self.mean_x) ** 2 or covariance <= 0:
            return None
        slope = covariance / spread
        return slope if self.mean_y - slope * self.mean_x >= 0 else None


@dataclass
class StepLine:
    """`seconds = fixed + tokens x marginal` over a node's prefill steps. A step costs the same few
    milliseconds whatever it carries (Python, the launch, the sampling), so the average cost per
    token of a short prefill is several times what its tokens add to a step; whether recomputing
    32 tokens beats pulling them is a question of the added cost, which only steps of different
    sizes show."""

    line: WeightedLine = field(default_factory=WeightedLine)

    def add(self, tokens: int, seconds: float) -> None:
        self.line.add(tokens, seconds)

    @property
    def marginal_s_per_token(self) -> float | None:
        return self.line.slope()


@dataclass
class NodeRates:
    prefill_s_per_token: Ewma
    decode_s_per_token: Ewma
    restore_s_per_byte: Ewma
    prefill_line: StepLine
    warmup_steps_left: int = WARMUP_STEPS

    @classmethod
    def new(cls) -> NodeRates:
        return cls(Ewma(), Ewma(), Ewma(), StepLine())

    def observe_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """Split one step's time between its prefill and decode tokens.

        A step mixes both; attributing time in proportion to token counts is crude but
        unbiased over many steps, and pure steps (all decode, all prefill) correct it.
        The first WARMUP_STEPS steps are not steady state and are left out.
        """
        total = prefill_tokens + decode_tokens
        if total == 0 or seconds <= 0:
            return
        if self.warmup_steps_left:
            self.warmup_steps_left -= 1
            return
        per_token = seconds / total
        if prefill_tokens:
            self.prefill_s_per_token.update(per_token)
            self.prefill_line.add(total, seconds)
        if decode_tokens:
            self.decode_s_per_token.update(per_token if prefill_tokens else seconds / decode_tokens)
