"""The detokenizer's fast path decodes exactly what the tokenizer wrapper decodes."""

from __future__ import annotations

import types

from orchard.node.detokenizer import IncrementalDetokenizer, fast_decoder
from orchard.node.model.loader import load_model


def test_fast_decoder_gives_the_wrappers_text_on_every_prefix_of_a_sentence():
    tokenizer = load_model(None).tokenizer
    ids = tokenizer.encode("The orchard's pears, ripe and ready — 3 baskets!") + [tokenizer.eos_token_id]
    decode = fast_decoder(tokenizer)
    for end in range(1, len(ids) + 1):
        assert decode(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_keeps_the_wrapper():
    calls = []
    inner = types.SimpleNamespace(backend_tokenizer=object(), clean_up_tokenization_spaces=True)
    wrapper = types.SimpleNamespace(_tokenizer=inner, decode=lambda ids, skip_special_tokens: calls.append(ids) or "x")
    assert fast_decoder(wrapper)([1, 2]) == "x" and calls == [[1, 2]]


def test_streamed_deltas_concatenate_to_the_whole_text():
    tokenizer = load_model(None).tokenizer
    ids = tokenizer.encode("An orchard of apple trees in bloom")
    detok = IncrementalDetokenizer(tokenizer, ids[:2])
    text = "".join(detok.add(t) for t in ids[2:])
    whole, prompt = (tokenizer.decode(x, skip_special_tokens=True) for x in (ids, ids[:2]))
    assert text == whole[len(prompt):]


def test_a_prompt_ending_inside_a_character_never_streams_the_prompts_text():
    tokenizer = load_model(None).tokenizer
    ids = tokenizer.encode("pears 日本 and apples")
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, ids[:cut])
    text = "".join(detok.add(t) for t in ids[cut:])
    assert "pears" not in text and text.endswith("本 and apples")


def test_the_rust_stream_and_the_two_decode_window_agree_on_whole_characters():
    tokenizer = load_model(None).tokenizer
    ids = tokenizer.encode("An orchard: Ünïcödé 日本語 🍐🍐 — 3 baskets!\n\n  end")
    for cut in range(0, len(ids), 3):
        if tokenizer.decode(ids[:cut]).endswith("\ufffd"):
            continue  # a character cut in half by the prompt: the window drops it (see the test above)
        stream = IncrementalDetokenizer(tokenizer, ids[:cut])
        window = IncrementalDetokenizer(tokenizer, ids[:cut], decode=fast_decoder(tokenizer))
        assert stream._backend is not None and window._backend is None
        assert "".join(stream.add(t) for t in ids[cut:]) == "".join(window.add(t) for t in ids[cut:])
