"""A backend whose model says what the test scripts: the demo model's real tokenizer, and
for output the script's tokens one per step, detokenized as the engine does.

The random-weight demo model cannot be made to call a tool; this one can, so the gateway's
parsing, streaming and SDK shapes are tested end to end on known answers.
"""

from __future__ import annotations

from mlx_lm.utils import load_tokenizer

from orchard.cluster.gateway.backend import ModelInfo
from orchard.node.detokenizer import IncrementalDetokenizer
from orchard.node.model.demo import default_demo_model_path
from orchard.node.types import CompletionOutput, RequestOutput

MODEL = "scripted"


def demo_tokenizer(chat_template: str | None = None):
    """A private copy of the demo tokenizer (the shared engine's is left as it is)."""
    tokenizer = load_tokenizer(default_demo_model_path())
    if chat_template is not None:
        from orchard.cluster.cli.serving_logs import apply_chat_template

        apply_chat_template(tokenizer, chat_template)
    return tokenizer


class ScriptedBackend:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.script = ""
        self.prompts: list[list[int]] = []  # every prompt handed to the model, in order
        self.sessions: list[str | None] = []  # the session key each of those requests named

    async def models(self) -> list[ModelInfo]:
        return [ModelInfo(MODEL, 4096, self.tokenizer)]

    async def ready(self) -> bool:
        return True

    async def generate(self, request_id, model, prompt_token_ids, params, session=None):
        self.prompts.append(list(prompt_token_ids))
        self.sessions.append(session)
        ids = list(self.tokenizer.encode(self.script, add_special_tokens=False))[: params.max_tokens]
        detoks = [IncrementalDetokenizer(self.tokenizer, prompt_token_ids) for _ in range(params.n)]
        for step, token in enumerate(ids):
            last = step == len(ids) - 1
            outputs = []
            for i, detok in enumerate(detoks):
                delta = detok.add(token)
                outputs.append(CompletionOutput(
                    index=i, text=detok.text, token_ids=ids[: step + 1], text_delta=delta, token_ids_delta=[token],
                    finish_reason=("stop" if len(ids) < params.max_tokens else "length") if last else None))
            yield RequestOutput(request_id, list(prompt_token_ids), outputs, finished=last)

    async def abort(self, request_id) -> None:
        return None

    async def cluster_info(self) -> dict:
        return {"model": MODEL, "nodes": [], "queue_depth": 0}

    async def queue_depth(self) -> int:
        return 0

    async def shutdown(self) -> None:
        return None
