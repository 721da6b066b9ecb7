"""Which conversation a request continues, as the SDKs send it, reaches the backend's routing
(orchard/cluster/gateway/sessions.py): X-Session-Id, prompt_cache_key, user, Anthropic metadata.user_id."""

from __future__ import annotations

import anthropic
import openai
import pytest

from orchard.cluster.gateway.app import create_app
from orchard.cluster.gateway.state import GatewayConfig
from tests.gateway.live_server import LiveServer
from tests.gateway.scripted import MODEL, ScriptedBackend, demo_tokenizer

KEY = "session-test-key-0123"
ASK = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served():
    backend = ScriptedBackend(demo_tokenizer())
    backend.script = "Hi."
    with LiveServer(create_app(backend, GatewayConfig(request_timeout_s=30.0, api_keys=frozenset({KEY})))) as live:
        yield backend, openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0), \
            anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0)


def test_chat_takes_prompt_cache_key_then_user_and_the_header_wins(served):
    backend, client, _ = served
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, user="alice")
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, user="alice", prompt_cache_key="thread-7")
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, user="alice",
                                   extra_headers={"X-Session-Id": "agent-run-3"})
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    assert backend.sessions[-4:] == ["alice", "thread-7", "agent-run-3", None]


def test_completions_and_responses_name_their_sessions_too(served):
    backend, client, _ = served
    client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4, user="bob")
    assert backend.sessions[-2:] == ["bob", "bob"]  # every prompt of the request
    client.responses.create(model=MODEL, input="hello", max_output_tokens=4, prompt_cache_key="resp-thread")
    assert backend.sessions[-1] == "resp-thread"


def test_anthropic_metadata_user_id_is_the_session(served):
    backend, _, claude = served
    claude.messages.create(model=MODEL, max_tokens=4, messages=ASK, metadata={"user_id": "claude-session-9"})
    assert backend.sessions[-1] == "claude-session-9"


def test_an_over_long_key_is_refused_in_each_apis_own_shape(served):
    backend, client, claude = served
    before = len(backend.prompts)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, user="u" * 257)
    assert chat.value.body["param"] == "user" and "256" in chat.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as messages:
        claude.messages.create(model=MODEL, max_tokens=4, messages=ASK, extra_headers={"X-Session-Id": "s" * 300})
    assert messages.value.body["type"] == "error" and "x-session-id" in messages.value.body["error"]["message"]
    assert len(backend.prompts) == before  # nothing reached the model
