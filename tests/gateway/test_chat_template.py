"""Chat messages to prompt ids: the model's template when it has one, ChatML otherwise."""

from __future__ import annotations

import pytest

from cluster.gateway.chat_template import CHATML_END, ChatTemplateError, build_chat_prompt, render_chatml

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_chatml_layout_ends_with_the_assistant_turn_open():
    assert render_chatml(MESSAGES) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_model_without_template_gets_chatml_and_stops_at_its_end_marker(tokenizer):
    prompt = build_chat_prompt(tokenizer, MESSAGES)
    assert prompt.token_ids == list(tokenizer.encode(render_chatml(MESSAGES)))
    assert prompt.stop == [CHATML_END]


class TemplatedTokenizer:
    has_chat_template = True

    def __init__(self, fail: bool = False):
        self.fail = fail

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        if self.fail:
            raise ValueError("Conversation roles must alternate user/assistant")
        assert add_generation_prompt and tokenize
        return [100 + len(m["content"]) for m in messages]


def test_model_template_is_used_as_is_with_no_extra_stop():
    prompt = build_chat_prompt(TemplatedTokenizer(), MESSAGES)
    assert prompt.token_ids == [108, 102] and prompt.stop == [] and prompt.stop_token_ids == []


def test_template_refusal_becomes_a_chat_template_error():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        build_chat_prompt(TemplatedTokenizer(fail=True), MESSAGES)
