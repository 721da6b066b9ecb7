"""/v1/chat/completions through the official openai client against a live server."""

from __future__ import annotations

from orchard.cluster.gateway.chat_template import build_chat_prompt

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a fruit"}]


def chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=kw.pop("messages", MESSAGES), temperature=0, **kw)


def test_prompt_tokens_are_the_templated_conversation(client, model_name, tokenizer):
    out = chat(client, model_name, max_completion_tokens=4)
    assert out.usage.prompt_tokens == len(build_chat_prompt(tokenizer, MESSAGES).token_ids)
    assert out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion"


def test_max_completion_tokens_bounds_the_answer(client, model_name):
    out = chat(client, model_name, max_completion_tokens=3)
    assert out.usage.completion_tokens <= 3
    assert out.choices[0].finish_reason == ("length" if out.usage.completion_tokens == 3 else "stop")


def test_streamed_deltas_concatenate_to_the_greedy_message(client, model_name):
    whole = chat(client, model_name, max_tokens=12)
    chunks = list(chat(client, model_name, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage == whole.usage


def test_n_greedy_answers_are_identical_and_indexed(client, model_name):
    out = chat(client, model_name, max_tokens=5, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) == 1


def test_logprobs_carry_top_alternatives_with_bytes(client, model_name):
    out = chat(client, model_name, max_tokens=4, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: the chosen token is the most likely
    assert "".join(e.token for e in content) == out.choices[0].message.content


def test_no_logprobs_unless_asked(client, model_name):
    out = chat(client, model_name, max_tokens=2)
    assert out.choices[0].logprobs is None
