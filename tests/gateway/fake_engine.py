"""A stand-in for `node.async_engine.AsyncEngine`: byte tokens, deterministic outputs.

Used where a test needs an engine whose timing or state it controls exactly (a queue
that never drains, a node that is not ready); everything else runs the real engine.
"""

from __future__ import annotations

import asyncio
import math
import random

from node.types import CompletionOutput, RequestOutput, SamplingParams, TokenLogprob

BOS, EOS = 256, 257


class ByteTokenizer:
    """One token per UTF-8 byte, plus BOS and EOS; no chat template."""

    has_chat_template = False
    eos_token_id = EOS

    def __len__(self) -> int:
        return 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FakeAsyncEngine:
    """Emits lowercase letters, one per step, each `step_s` apart; blocks of `block_size`."""

    def __init__(self, max_model_len: int = 256, step_s: float = 0.002, block_size: int = 16, num_blocks: int = 512):
        self.tokenizer = ByteTokenizer()
        self.model_name = "fake"
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.active: dict[str, int] = {}  # request id -> tokens held
        self.aborted: set[str] = set()

    def stats(self) -> dict:
        used = sum(math.ceil(t / self.block_size) for t in self.active.values())
        return {"kv_blocks_used": used, "kv_blocks_total": self.num_blocks, "num_running": len(self.active)}

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        self.active.pop(request_id, None)

    def _token(self, rng: random.Random | None, prompt: list[int], step: int, index: int) -> int:
        if rng is None:
            return ord("a") + (sum(prompt) + step) % 26
        return ord("a") + rng.randrange(26)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.active[request_id] = len(prompt_token_ids)
        rngs = [None if params.greedy else random.Random((params.seed or 0) + i) for i in range(params.n)]
        outs = [CompletionOutput(index=i) for i in range(params.n)]
        try:
            for step in range(params.max_tokens):
                await asyncio.sleep(self.step_s)
                if request_id in self.aborted:
                    return
                self.active[request_id] += 1
                for c in outs:
                    if c.finished:
                        c.text_delta, c.token_ids_delta, c.logprobs_delta = "", [], []
                        continue
                    self._advance(c, self._token(rngs[c.index], prompt_token_ids, step, c.index), params, step)
                done = all(c.finished for c in outs)
                yield RequestOutput(request_id, prompt_token_ids, [_copy(c) for c in outs], finished=done)
                if done:
                    return
        finally:
            self.active.pop(request_id, None)

    def _advance(self, c: CompletionOutput, token: int, params: SamplingParams, step: int) -> None:
        piece = chr(token)
        c.token_ids = c.token_ids + [token]
        c.token_ids_delta = [token]
        top = [(ord("a") + k, -0.5 - k) for k in range(params.logprobs or 0)]
        c.logprobs_delta = [TokenLogprob(token, -0.5, top)] if params.logprobs is not None else []
        text = c.text + piece
        for stop in params.stop:
            if stop in text:
                text = text[: text.index(stop)]
                c.finish_reason, c.stop_reason = "stop", stop
        c.text_delta = text[len(c.text):]
        c.text = text
        if c.finish_reason is None and step + 1 >= params.max_tokens:
            c.finish_reason = "length"


def _copy(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        c.index, c.text, list(c.token_ids), c.text_delta, list(c.token_ids_delta), list(c.logprobs_delta), c.finish_reason, c.stop_reason
    )
