"""What a node's output stream carries over the network: only what is new.

In the engine a `CompletionOutput` holds both the continuation so far (`token_ids`, `text`)
and this step's delta, and `RequestOutput` the prompt: free in one process, but pickled
into every streamed object they would make a 1,000-token answer ship ~500k token ids. The
node sends `only_new(output)`; the receiving side rebuilds the cumulative fields from the
deltas with one `Cumulative` per stream, so code past it sees what the engine produced.
"""

from __future__ import annotations

from dataclasses import replace

from orchard.node.types import CompletionOutput, RequestOutput


def only_new(output: RequestOutput) -> RequestOutput:
    """`output` without the prompt and the continuations so far (the deltas stay)."""
    return replace(output, prompt_token_ids=[], outputs=[replace(c, token_ids=[], text="") for c in output.outputs])


class Cumulative:
    """Rebuilds the cumulative fields of one stream's outputs from their deltas, in arrival order."""

    def __init__(self, prompt_token_ids: list[int]):
        self.prompt_token_ids = prompt_token_ids
        self._ids: dict[int, list[int]] = {}
        self._text: dict[int, str] = {}

    def __call__(self, output: RequestOutput) -> RequestOutput:
        return replace(output, prompt_token_ids=self.prompt_token_ids, outputs=[self._completion(c) for c in output.outputs])

    def _completion(self, c: CompletionOutput) -> CompletionOutput:
        ids = self._ids.setdefault(c.index, [])
        ids.extend(c.token_ids_delta)
        self._text[c.index] = self._text.get(c.index, "") + c.text_delta
        return replace(c, token_ids=list(ids), text=self._text[c.index])
