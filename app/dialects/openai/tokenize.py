"""The tokenizer API, in vLLM's shapes: the served model's own tokenizer and chat template, so that a client
can count tokens, check that a conversation fits, or build a token-id prompt exactly as the server sees it.

    POST /v1/tokenize    {"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /v1/detokenize  {"tokens"} -> {"prompt"}

Each passes admission as a generation does (its ticket keeps the model from being swapped while the
tokenizer runs) and tokenizes off the event loop; a prompt is size-checked first, as for /v1/completions.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from kvforge.app.context import ServerContext
from kvforge.app.dialects.openai.protocol import DetokenizeRequest, TokenizeRequest
from kvforge.app.generate.chat_request import chat_prompt_text
from kvforge.app.generate.completion import check_prompt_chars
from kvforge.app.generate.off_loop import off_loop
from kvforge.app.http.errors import APIError
from kvforge.core.tokenizer import Tokenizer


def tokenize_router(context: ServerContext) -> APIRouter:
    admission = context.admission
    router = APIRouter()

    @router.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        admission.check_model(body.model)
        if body.prompt is None and body.messages is None:
            raise APIError(400, "prompt: give a prompt (text) or messages (a conversation)", "prompt")
        ticket = await admission.enter(body.model)
        try:
            engine = ticket.engine
            chars = len(body.prompt) if body.messages is None else sum(len(m.text()) for m in body.messages)
            check_prompt_chars(engine, chars, "prompt" if body.messages is None else "messages")
            tokens, token_strs = await off_loop(tokenize_body, engine.tokenizer, body)
            max_model_len = engine.engine.max_model_len
        finally:
            ticket.release()
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}

    @router.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        admission.check_model(body.model)
        ticket = await admission.enter(body.model)
        try:
            text = await run_in_threadpool(detokenize_ids, ticket.engine.tokenizer, body.tokens)
        finally:
            ticket.release()
        return {"prompt": text}

    return router


def tokenize_body(tokenizer: Tokenizer, body: TokenizeRequest) -> tuple[list[int], list[str] | None]:
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
        tokens = tokenizer.encode(text, add_special_tokens=body.with_special_tokens())
    return tokens, tokenizer.hf.convert_ids_to_tokens(tokens) if body.return_token_strs else None


def detokenize_ids(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The text of `tokens`, special tokens kept (so that tokenize -> detokenize gives the text back);
    APIError 400 naming tokens for an id outside the vocabulary."""
    outside = next((t for t in tokens if t >= tokenizer.vocab_size), None)
    if outside is not None:
        raise APIError(400, f"tokens: {outside} is outside the vocabulary [0, {tokenizer.vocab_size})", "tokens")
    return tokenizer.decode(tokens, skip_special_tokens=False)
