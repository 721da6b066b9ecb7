"""/v1/completions through the official openai client against a live server."""

from __future__ import annotations

PROMPT = "the quick brown fox"


def greedy(client, model, **kw):
    return client.completions.create(model=model, prompt=kw.pop("prompt", PROMPT), temperature=0, **kw)


def test_usage_counts_prompt_tokens_as_the_tokenizer_does(client, model_name, tokenizer):
    out = greedy(client, model_name, max_tokens=6, logprobs=0)
    choice = out.choices[0]
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == len(choice.logprobs.tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert out.usage.completion_tokens == 6


def test_streamed_chunks_concatenate_to_the_greedy_text(client, model_name):
    whole = greedy(client, model_name, max_tokens=12)
    chunks = list(greedy(client, model_name, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stream_without_include_usage_sends_no_usage(client, model_name):
    chunks = list(greedy(client, model_name, max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_token_id_prompt_gives_the_same_text_as_the_string(client, model_name, tokenizer):
    by_text = greedy(client, model_name, max_tokens=8)
    by_ids = greedy(client, model_name, max_tokens=8, prompt=tokenizer.encode(PROMPT))
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage == by_text.usage


def test_list_of_prompts_and_n_give_one_choice_per_prompt_and_sample(client, model_name, tokenizer):
    other = "a different start"
    out = greedy(client, model_name, max_tokens=5, n=2, prompt=[PROMPT, other])
    by_ids = greedy(client, model_name, max_tokens=5, n=2, prompt=[tokenizer.encode(PROMPT), tokenizer.encode(other)])
    assert [c.text for c in by_ids.choices] == [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    first, second = greedy(client, model_name, max_tokens=5), greedy(client, model_name, max_tokens=5, prompt=other)
    assert [c.text for c in out.choices] == [first.choices[0].text] * 2 + [second.choices[0].text] * 2
    assert out.usage.prompt_tokens == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert out.usage.completion_tokens == 2 * (first.usage.completion_tokens + second.usage.completion_tokens)


def test_streaming_n_keeps_each_choice_apart(client, model_name):
    whole = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, n=3, seed=7, temperature=1.0)
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, n=3, seed=7, temperature=1.0, stream=True))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in whole.choices]


def test_same_seed_repeats_a_sampled_completion(client, model_name):
    a = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1234)
    b = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1234)
    assert a.choices[0].text == b.choices[0].text


def test_stop_string_ends_the_text_before_it(client, model_name):
    full = greedy(client, model_name, max_tokens=16).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert len(stop) == 2
    cut = greedy(client, model_name, max_tokens=16, stop=[stop]).choices[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"


def test_logprobs_list_top_alternatives_and_the_chosen_token(client, model_name):
    out = greedy(client, model_name, max_tokens=5, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == logprob
        assert logprob <= 0.0 and logprob == max(top.values())  # greedy picks the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_models_lists_the_served_model(client, model_name, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert models.data[0].max_model_len == engine.max_model_len


def test_ignore_eos_generates_exactly_max_tokens(client, model_name):
    for prompt in ("one", "two words", "and three more"):
        out = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"


def test_top_k_of_one_samples_the_greedy_text(client, model_name):
    sampled = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, extra_body={"top_k": 1})
    assert sampled.choices[0].text == greedy(client, model_name, max_tokens=8).choices[0].text

