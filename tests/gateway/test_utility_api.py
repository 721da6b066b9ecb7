"""vLLM's small endpoints: a model's card, tokenize (text and chat), detokenize, version; bad input is a 4xx."""

from __future__ import annotations


def test_one_models_card_and_an_unknown_one(http, model_name):
    card = http.get(f"/v1/models/{model_name}")
    assert card.status_code == 200 and card.json()["id"] == model_name and card.json()["max_model_len"] == 256
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_and_detokenize_round_trip_as_the_tokenizer_does(http, model_name, tokenizer):
    text = "The orchard's pears ripen late."
    got = http.post("/tokenize", json={"model": model_name, "prompt": text}).json()
    assert got["tokens"] == list(tokenizer.encode(text)) and got["count"] == len(got["tokens"]) and got["max_model_len"] == 256
    back = http.post("/detokenize", json={"model": model_name, "tokens": got["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(got["tokens"])


def test_tokenizing_a_chat_counts_what_a_chat_request_sends(http, client, model_name):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a pear."}]
    counted = http.post("/tokenize", json={"model": model_name, "messages": messages}).json()["count"]
    answer = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    assert counted == answer.usage.prompt_tokens


def test_bad_input_is_refused_in_the_apis_shape(http, model_name):
    both = http.post("/tokenize", json={"model": model_name, "prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    outside = http.post("/detokenize", json={"model": model_name, "tokens": [10**9]})
    unknown = http.post("/detokenize", json={"model": "no-such-model", "tokens": [1]})
    assert (both.status_code, outside.status_code, unknown.status_code) == (400, 400, 404)
    assert outside.json()["error"]["param"] == "tokens"


def test_version_names_the_package(http):
    from orchard.cluster.discovery.adverts import orchard_version

    assert http.get("/version").json() == {"version": orchard_version()}
