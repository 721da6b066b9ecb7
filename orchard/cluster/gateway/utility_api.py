"""The small endpoints vLLM serves beside the OpenAI API: one model's card, tokenize, detokenize, version.

Clients and tools written against vLLM call them (token counting before a request,
checking what a server runs); their shapes follow vLLM's. Tokenizing messages goes
through the same chat template path a chat request takes, so the count is the prompt's.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from pydantic import Field

from orchard.cluster.gateway.chat_serving import ChatServing
from orchard.cluster.gateway.errors import InvalidRequest, ModelNotFound
from orchard.cluster.gateway.protocol import ChatCompletionRequest, ChatMessage, ModelCard, _Request, _Response
from orchard.cluster.gateway.state import Gateway


class TokenizeRequest(_Request):
    model: str = Field(min_length=1)  # as a chat request's: its messages are templated as one
    prompt: str | None = Field(None, description="text to tokenize; or give messages")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="a chat, tokenized as its chat-template prompt")
    add_special_tokens: bool = True


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str = Field(min_length=1)
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


def install_utility_api(app: FastAPI, gw: Gateway, chats: ChatServing, auth: list, errors: dict) -> None:
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=auth, responses=errors)
    async def model_card(model_id: str) -> ModelCard:
        served = await gw.backend.models() if await gw.backend.ready() else []
        for info in served:
            if info.name == model_id:
                return ModelCard(id=info.name, max_model_len=info.max_model_len)
        raise ModelNotFound(model_id, [m.name for m in served])

    @app.post("/tokenize", response_model=TokenizeResponse, dependencies=auth, responses=errors)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            info, *_, prompt = await chats.prompt(ChatCompletionRequest(model=body.model, messages=body.messages))
            tokens = list(prompt.token_ids)
        else:
            info = await gw.model(body.model)
            tokens = await asyncio.to_thread(_encode, info.tokenizer, body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=info.max_model_len, tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=auth, responses=errors)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        info = await gw.model(body.model)
        vocab = info.vocab_size or len(info.tokenizer.get_vocab())
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(info.tokenizer.decode, body.tokens))

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        from orchard.cluster.discovery.adverts import orchard_version

        return VersionResponse(version=orchard_version())


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
