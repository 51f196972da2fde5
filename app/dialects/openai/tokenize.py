"""The tokenizer API, in vLLM's shapes: the served model's own tokenizer and chat template, so that a client
can count tokens, check that a conversation fits, or build a token-id prompt exactly as the server sees it.

    POST /v1/tokenize    {"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /v1/detokenize  {"tokens"} -> {"prompt"}
    GET  /tokenizer_info -> {"tokenizer_class", "eos_token", "bos_token", "pad_token", "chat_template", ...}

/tokenize and /detokenize (no /v1) are the same routes under vLLM's paths: lm-eval's remote tokenizer asks
/tokenizer_info, /tokenize and /detokenize at the server's root.

Each passes admission as a generation does (its ticket keeps the model from being swapped while the
tokenizer runs) and tokenizes off the event loop; a prompt is size-checked first, as for /v1/completions.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field, ValidationInfo, field_validator
from starlette.concurrency import run_in_threadpool

from kvforge.app.context import ServerContext
from kvforge.app.dialects.openai.fields import FORBID, MAX_MESSAGES, MAX_TOOLS
from kvforge.app.dialects.openai.messages import ChatMessage
from kvforge.app.dialects.openai.protocol import TokenId
from kvforge.app.dialects.openai.tools import ChatCompletionFunctionTool, function_tools_only, template_variables
from kvforge.app.generate.chat_request import chat_prompt_text, prompt_with_pictures
from kvforge.app.generate.off_loop import off_loop
from kvforge.app.generate.request import check_prompt_chars
from kvforge.app.http.errors import APIError
from kvforge.core.tokenizer import Tokenizer


class TokenizeRequest(BaseModel):
    """POST /v1/tokenize: a `prompt` as text, or chat `messages` rendered by the chat template (exactly one).
    add_special_tokens defaults to true for a prompt and to false for messages (the template writes its own)."""

    model_config = FORBID
    model: str | None = None
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    # messages only
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionFunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)

    @field_validator("messages")
    @classmethod
    def _not_both(cls, messages: list[ChatMessage] | None, info: ValidationInfo) -> list[ChatMessage] | None:
        if messages is not None and info.data.get("prompt") is not None:
            raise ValueError("give either prompt or messages, not both")
        return messages

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        return function_tools_only(tools)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables(kwargs)

    @field_validator("add_generation_prompt", "chat_template_kwargs", "tools")
    @classmethod
    def _messages_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("messages", []) is None:  # absent there: messages itself failed
            raise ValueError("applies to messages only, not to a prompt")
        return value

    def with_special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(BaseModel):
    """POST /v1/detokenize: token ids back to text."""

    model_config = FORBID
    model: str | None = None
    tokens: list[TokenId]



def tokenize_router(context: ServerContext) -> APIRouter:
    admission = context.admission
    router = APIRouter()

    @router.post("/v1/tokenize")
    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        admission.check_model(body.model)
        if body.prompt is None and body.messages is None:
            raise APIError(400, "prompt: give a prompt (text) or messages (a conversation)", "prompt")
        ticket = await admission.enter(body.model)
        try:
            engine = ticket.engine
            chars = len(body.prompt) if body.messages is None else sum(len(m.text()) for m in body.messages)
            check_prompt_chars(engine, chars, "prompt" if body.messages is None else "messages")
            tokens, token_strs = await off_loop(tokenize_body, engine.tokenizer, body, context.picture_hosts)
            max_model_len = engine.engine.max_model_len
        finally:
            ticket.release()
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}

    @router.post("/v1/detokenize")
    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        admission.check_model(body.model)
        ticket = await admission.enter(body.model)
        try:
            text = await run_in_threadpool(detokenize_ids, ticket.engine.tokenizer, body.tokens)
        finally:
            ticket.release()
        return {"prompt": text}

    @router.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> dict:
        """The served model's tokenizer, as vLLM's: its class, special tokens and chat template, and the context."""
        admission.check_model(model)
        ticket = await admission.enter(model)
        try:
            engine = ticket.engine
            return tokenizer_description(engine.tokenizer, engine.engine.max_model_len)
        finally:
            ticket.release()

    return router


def tokenizer_description(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    hf = tokenizer.hf
    return {"tokenizer_class": type(hf).__name__, "eos_token": hf.eos_token, "bos_token": hf.bos_token,
            "pad_token": hf.pad_token, "unk_token": hf.unk_token, "chat_template": hf.chat_template,
            "model_max_length": max_model_len, "vocab_size": tokenizer.vocab_size,
            "add_bos_token": getattr(hf, "add_bos_token", None)}


def tokenize_body(tokenizer: Tokenizer, body: TokenizeRequest, picture_hosts: frozenset[str] = frozenset()
                  ) -> tuple[list[int], list[str] | None]:
    """The request's token ids (its prompt's, or its messages' as the chat template renders them), and each
    token's vocabulary entry when asked for (return_token_strs). APIError 400 for what cannot be tokenized."""
    if body.messages is None:
        try:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.with_special_tokens())
        except Exception as exc:  # text the tokenizer cannot take (e.g. a lone UTF-16 surrogate)
            raise APIError(400, f"prompt: cannot tokenize ({type(exc).__name__})", "prompt") from None
    else:
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        text = chat_prompt_text(tokenizer, body.messages, tools, body.chat_template_kwargs,
                                add_generation_prompt=body.add_generation_prompt is not False)
        urls = [url for m in body.messages for url in m.image_urls()]
        if urls:  # a vision model's: each picture's placeholder expanded into its image's tokens, as a chat's
            tokens = prompt_with_pictures(tokenizer, text, urls, picture_hosts)[0]
        else:
            tokens = tokenizer.encode(text, add_special_tokens=body.with_special_tokens())
    return tokens, tokenizer.hf.convert_ids_to_tokens(tokens) if body.return_token_strs else None


def detokenize_ids(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The text of `tokens`, special tokens kept (so that tokenize -> detokenize gives the text back);
    APIError 400 naming tokens for an id outside the vocabulary."""
    outside = next((t for t in tokens if t >= tokenizer.vocab_size), None)
    if outside is not None:
        raise APIError(400, f"tokens: {outside} is outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
    return tokenizer.decode(tokens, skip_special_tokens=False)
