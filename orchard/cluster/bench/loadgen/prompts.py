"""Prompt text of a requested length, measured in the target model's tokens where possible.

A benchmark's input lengths only mean something in the target model's tokens. With a
`tokenizer.json` the text is built from token ids and re-encoded until its length is
exact (or as close as the tokenizer's merges allow). With only the server's `/tokenize`,
each word's token count is asked once and prompts are composed of words to the exact
count (`WordTablePrompts`; `served_tokenizer` builds the table). Without either, words
stand in for tokens and every length is approximate, which the result file says.
"""

from __future__ import annotations

import bisect
import os
import random
from dataclasses import dataclass
from typing import Protocol

# Plain, short English words: most BPE vocabularies encode each as one or two tokens.
PROMPT_WORDS = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city name "
    "team minute idea kid body information back parent face others level office door "
    "health person art war history party result change morning reason research girl "
    "guy moment air teacher force education foot boy age policy music market sense "
    "nation plan college interest death experience effect use class control care field "
    "development role effort rate heart drug show leader light voice wife police mind "
    "price report decision son view relationship town road arm difference value "
    "building action model season society tax director position player record paper "
    "space ground form event official matter center couple site project activity star "
    "table need court oil situation cost industry figure street image phone data "
    "picture practice piece land product doctor wall patient worker news test movie "
    "north love support technology step baby computer type attention film tree source "
    "organization hair window evidence population site bed river garden orchard apple"
).split()


class PromptSource(Protocol):
    """Makes prompt text whose length is counted in the unit `exact` says."""

    exact: bool

    def text(self, num_tokens: int, rng: random.Random) -> str: ...

    def count(self, text: str) -> int: ...

    def describe(self) -> str: ...


class WordPrompts:
    """One random word per requested token: lengths are approximate."""

    exact = False

    def __init__(self, reason: str = "no tokenizer given") -> None:
        self.reason = reason

    def text(self, num_tokens: int, rng: random.Random) -> str:
        return " ".join(rng.choice(PROMPT_WORDS) for _ in range(num_tokens))

    def count(self, text: str) -> int:
        return len(text.split())

    def describe(self) -> str:
        return f"approximate: one word per token ({self.reason})"


class TokenizerPrompts:
    """Text decoded from random non-special token ids, re-encoded to fit the length."""

    exact = True
    _FIT_ATTEMPTS = 8

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self.path = file
        self._tok = Tokenizer.from_file(file)
        special = set(self._tok.get_added_tokens_decoder())
        # Tokens that are partial UTF-8 sequences decode to U+FFFD and re-encode longer.
        self._ids = [i for i in range(self._tok.get_vocab_size())
                     if i not in special and "\ufffd" not in self._tok.decode([i])]
        if not self._ids:
            raise ValueError(f"tokenizer {file} has no ordinary tokens to build prompts from")

    def text(self, num_tokens: int, rng: random.Random) -> str:
        ids = [rng.choice(self._ids) for _ in range(num_tokens)]
        text = self._tok.decode(ids)
        for _ in range(self._FIT_ATTEMPTS):
            ids = self._encode(text)
            if len(ids) == num_tokens:
                break
            ids = ids[:num_tokens] + [rng.choice(self._ids) for _ in range(num_tokens - len(ids))]
            text = self._tok.decode(ids)
        return text

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def describe(self) -> str:
        return f"tokens of {self.path}"

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


class WordTablePrompts:
    """Words whose token counts are known, composed to an exact total.

    `first` and `after` give each word's count at the start of a text and after a space.
    Pre-tokenizers split at spaces, so a text's count is the sum of its words' counts;
    `served_tokenizer` checks that on samples and says `exact=False` where it does not hold.
    Each text opens with a word counted the same both ways, so a text appended after a
    space (a prefix-repetition suffix) keeps its count.
    """

    def __init__(self, first: dict[str, int], after: dict[str, int], describe: str, exact: bool = True) -> None:
        self._first, self._after, self._describe, self.exact = first, after, describe, exact
        ranked = sorted(after.items(), key=lambda item: (item[1], item[0]))
        self._words = [w for w, _ in ranked]
        self._counts = [n for _, n in ranked]  # ascending: words[:bisect(counts, k)] fit in k tokens
        self._openers = sorted(w for w, n in first.items() if after.get(w) == n) or sorted(first)
        if not self._counts or self._counts[0] != 1 or min(first.values()) != 1:
            raise ValueError("no word is a single token: lengths cannot be composed exactly")

    def text(self, num_tokens: int, rng: random.Random) -> str:
        fits = [w for w in self._openers if self._first[w] <= num_tokens]
        words = [rng.choice(fits or [w for w, n in self._first.items() if n == 1])]
        left = num_tokens - self._first[words[0]]
        while left > 0:
            word = self._words[rng.randrange(bisect.bisect_right(self._counts, left))]
            words.append(word)
            left -= self._after[word]
        return " ".join(words)

    def count(self, text: str) -> int:
        first, *rest = text.split(" ")
        return self._first[first] + sum(self._after[w] for w in rest)

    def describe(self) -> str:
        return self._describe


@dataclass(frozen=True)
class LengthRange:
    """A target length and the fraction it may vary by, drawn uniformly per request."""

    mean: int
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length must be at least 1, got {self.mean}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")

    @property
    def low(self) -> int:
        return max(1, round(self.mean * (1 - self.range_ratio)))

    @property
    def high(self) -> int:
        return max(self.low, round(self.mean * (1 + self.range_ratio)))

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)
