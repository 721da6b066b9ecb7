"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.types import RequestOutput, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.engine.warm_up()  # steps run in this thread
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling params")
        ids = [f"offline-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, per_prompt):
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.add_request(rid, tokens, p)
        finals: dict[str, RequestOutput] = {}
        with Progress(
            TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not progress
        ) as bar:
            task = bar.add_task("requests", total=len(ids))
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        bar.advance(task)
        return [finals[rid] for rid in ids]
