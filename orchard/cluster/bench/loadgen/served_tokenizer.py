"""Which prompt source a `bench serve` run sizes its prompts with, in the served model's tokens.

In order: `--tokenizer` (a local tokenizer.json); the server's `/tokenize` (orchard and
vLLM serve it), asked once for each word of the prompt vocabulary, alone and after a
space, then checked on sample prompts; the tokenizer of the model the server names, when
that is a folder or a Hugging Face cache entry on this machine (mlx_lm.server names its
`--model` path); else one word per token, approximate, and the result says why.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx

from orchard.cluster.bench.loadgen.client import EndpointConfig
from orchard.cluster.bench.loadgen.prompts import PROMPT_WORDS, PromptSource, TokenizerPrompts, WordPrompts, WordTablePrompts

_IN_FLIGHT = 8  # /tokenize calls at once while the table is built
_CHECK_LENGTHS = (1, 2, 5, 17, 64, 200)
SERVED = "tokens of the served model (its /tokenize)"
NO_TOKENIZER = "the server has no /tokenize and names no tokenizer found on this machine"


async def choose_prompt_source(http: httpx.AsyncClient, endpoint: EndpointConfig,
                               tokenizer_path: str | None) -> PromptSource:
    """The most exact prompt source this run can have (module docstring: the order)."""
    if tokenizer_path:
        return TokenizerPrompts(tokenizer_path)
    if not endpoint.model:
        return WordPrompts("the server named no model to ask /tokenize about")
    served = await served_word_table(http, endpoint)
    if served is not None:
        return served
    local = local_tokenizer(endpoint.model)
    return TokenizerPrompts(local) if local else WordPrompts(NO_TOKENIZER)


async def served_word_table(http: httpx.AsyncClient, endpoint: EndpointConfig) -> WordTablePrompts | None:
    """Every prompt word's token count from the server's /tokenize; None if it has none."""
    tokenize = Tokenize(http, endpoint)
    if await tokenize.count(PROMPT_WORDS[0]) is None:
        return None
    words = sorted(set(PROMPT_WORDS))
    first = await tokenize.counts(words)
    after = await tokenize.counts([" " + w for w in words])
    if None in first or None in after:
        return None
    first_of, after_of = dict(zip(words, first)), dict(zip(words, after))
    try:
        table = WordTablePrompts(first_of, after_of, SERVED)
    except ValueError:  # no single-token word: a local tokenizer, if any, does better
        return None
    off = await misfits(table, tokenize)
    if off:
        why = f"approximate: the served tokenizer does not count words one by one ({off} of {len(_CHECK_LENGTHS) + 1} checks off)"
        return WordTablePrompts(first_of, after_of, why, exact=False)
    return table


async def misfits(table: WordTablePrompts, tokenize: Tokenize) -> int:
    """How many sample prompts (one of them a text appended after another) the server counts otherwise."""
    rng = random.Random(0)
    texts = [table.text(n, rng) for n in _CHECK_LENGTHS]
    texts.append(texts[-1] + " " + texts[2])
    counts = await tokenize.counts(texts)
    return sum(got != table.count(text) for text, got in zip(texts, counts))


def local_tokenizer(model: str) -> str | None:
    """The tokenizer.json of `model` when it names a folder here or a model in the Hugging Face cache."""
    folder = Path(model).expanduser()
    if (folder / "tokenizer.json").is_file():
        return str(folder)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "tokenizer.json")
    except (ImportError, ValueError):  # ValueError: not a valid repository id
        return None
    return found if isinstance(found, str) else None


class Tokenize:
    """The server's /tokenize: a text's token count without special tokens, None when it cannot say."""

    def __init__(self, http: httpx.AsyncClient, endpoint: EndpointConfig) -> None:
        self._http, self._endpoint = http, endpoint
        self._url = endpoint.base_url.rstrip("/") + "/tokenize"
        self._slots = asyncio.Semaphore(_IN_FLIGHT)

    async def count(self, text: str) -> int | None:
        body = {"model": self._endpoint.model, "prompt": text, "add_special_tokens": False}
        async with self._slots:
            try:
                resp = await self._http.post(self._url, json=body, headers=self._endpoint.headers())
                count = resp.json().get("count") if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):  # no answer, not JSON, not an object
                return None
        return count if isinstance(count, int) else None

    async def counts(self, texts: list[str]) -> list[int | None]:
        return list(await asyncio.gather(*(self.count(t) for t in texts)))
