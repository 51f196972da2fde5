"""A request made ready for the engine and queued: its sampling fields over the model's defaults into validated
SamplingParams (a 400 naming the field otherwise), a max_tokens that fits the context (or the window a request asks
for), its constraint compiled off the event loop, a prompt too long for any tokenization refused before tokenizing."""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.app.dialects.openai.protocol import SamplingFields
from kvforge.app.http.errors import APIError
from kvforge.core.async_engine import AsyncEngine, RequestStream
from kvforge.core.constraint import Constraint, InvalidConstraint
from kvforge.core.sampling import SamplingParams
from kvforge.core.scheduler import RequestRejected


@dataclass(frozen=True)
class ContextWindow:
    """A context a request asks for (Ollama's options.num_ctx): its prompt must fit, and its output stops where the
    window ends. Larger than the model's context: the model's."""

    tokens: int
    field: str  # the request field that set it, named when the prompt does not fit


def submit(engine: AsyncEngine, prompt: list[int], body: SamplingFields, default_max_tokens: int,
           logprobs: int | None, prompt_field: str, constraint: Constraint | None = None,
           skip_special_tokens: bool = True,
           window: ContextWindow | None = None) -> tuple[RequestStream, SamplingParams]:
    """Queue the request (held to `constraint`, compiled beforehand off the event loop); APIError 400 naming the
    field for bad sampling values or a prompt that cannot fit (`prompt_field` names where the prompt came from)."""
    defaults = engine.engine.generation_defaults.values
    body = body.over_defaults(defaults)
    default_max_tokens = defaults.get("max_tokens", default_max_tokens)
    try:
        params = body.sampling_params(default_max_tokens, logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split()[0]) from None
    params.constraint, params.skip_special_tokens = constraint, skip_special_tokens
    context = engine.engine.max_model_len
    if window is not None:
        context = min(context, window.tokens)
        if len(prompt) >= context:
            raise APIError(400, f"{window.field}: the prompt's {len(prompt)} tokens leave no room in a context of "
                           f"{context} tokens", window.field, code="context_length_exceeded")
        params.max_tokens = min(params.max_tokens, context - len(prompt))
    if params.max_tokens == default_max_tokens and body.requested_max_tokens() is None:
        # no explicit limit: fit what is left of the context instead of rejecting the request
        params.max_tokens = max(1, min(params.max_tokens, context - len(prompt)))
    try:
        stream = engine.add_request(prompt, params)
    except RequestRejected as exc:
        raise APIError(400, str(exc), prompt_field, code="context_length_exceeded") from None
    except ValueError as exc:  # the prompt's token ids, or logit_bias's, outside the vocabulary
        param = "logit_bias" if str(exc).startswith("logit_bias") else prompt_field
        raise APIError(400, str(exc), param) from None
    return stream, params


def compile_constraint(engine: AsyncEngine, constraint: Constraint, field: str) -> None:
    """Compile (and cache) a request's constraint before it is queued, off the event loop and the engine thread;
    APIError 400 naming `field` when it cannot be enforced."""
    try:
        engine.engine.compile_constraint(constraint)
    except InvalidConstraint as exc:
        raise APIError(400, f"{field}: cannot be enforced: {exc}", field) from None


def check_prompt_chars(engine: AsyncEngine, chars: int, prompt_field: str) -> None:
    """Refuse, before tokenizing it, a prompt too long to fit the context whatever its tokens: more than
    max_model_len times the longest token's characters (see Tokenizer.max_token_chars)."""
    context = engine.engine.max_model_len
    if chars > context * engine.tokenizer.max_token_chars:
        raise APIError(400, f"{prompt_field}: {chars} characters cannot fit this model's context of {context} "
                       "tokens", prompt_field, code="context_length_exceeded")
