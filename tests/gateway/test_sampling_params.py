"""What the engine is asked for: OpenAI request fields mapped to SamplingParams."""

from __future__ import annotations

from orchard.cluster.gateway.protocol import ChatCompletionRequest, CompletionRequest
from orchard.cluster.gateway.serving import sampling_params
from orchard.node.types import SamplingParams


def test_defaults_follow_openai():
    body = CompletionRequest(model="m", prompt="p")
    assert sampling_params(body, 16, None, [], []) == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)


def test_every_field_reaches_the_engine():
    body = CompletionRequest(
        model="m", prompt="p", n=3, temperature=0.7, top_p=0.9, seed=-5, presence_penalty=0.5, frequency_penalty=-0.25,
        stop=["x", "yz"], logprobs=2, user="u", top_k=40, min_p=0.05, repetition_penalty=1.1, ignore_eos=True,
        stop_token_ids=[9],
    )
    params = sampling_params(body, 32, body.logprobs, body.stop_list(), [7])
    assert params == SamplingParams(
        max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=-5, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.1, stop=["x", "yz"], stop_token_ids=[7, 9], ignore_eos=True,
        logprobs=2, n=3,
    )


def test_chat_prefers_max_completion_tokens_over_max_tokens():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=50, max_completion_tokens=5)
    assert body.token_limit() == 5
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=50).token_limit() == 50


def test_a_single_stop_string_becomes_a_list():
    assert CompletionRequest(model="m", prompt="p", stop="END").stop_list() == ["END"]
    assert CompletionRequest(model="m", prompt="p").stop_list() == []
