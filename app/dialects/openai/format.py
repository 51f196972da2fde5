"""OpenAI's response fields from the engine's outputs and the reply's parts: a stream's deltas and a whole message
(content, reasoning_content, tool_calls), finish_reason, usage (with cached tokens), logprobs objects, and
kvforge's extra `timings` (ttft_ms, tpot_ms, tokens_per_second, queue_ms); the other dialects and the sessions API
reuse them where their shapes match."""

from __future__ import annotations

from typing import Any

from kvforge.app.generate.reply import Part, Text, Thinking, ToolCall, WholeReply
from kvforge.core.output import RequestOutput, TokenLogprob


def tool_call(call: ToolCall, streamed: bool = False) -> dict[str, Any]:
    """A call as a message's `tool_calls` item, or `streamed` as a delta's (with its index)."""
    shaped = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    return {"index": call.index, **shaped} if streamed else shaped


def delta(part: Part, both_reasoning_names: bool = False) -> dict[str, Any]:
    """One part of a streamed reply as OpenAI's delta fields; thinking as reasoning_content, and with
    `both_reasoning_names` also as reasoning (the chat route's, for every client family: see message())."""
    if isinstance(part, Thinking):
        return {"reasoning_content": part.text} | ({"reasoning": part.text} if both_reasoning_names else {})
    if isinstance(part, Text):
        return {"content": part.text}
    return {"tool_calls": [tool_call(part, streamed=True)]}


def message(reply: WholeReply) -> dict[str, Any]:
    """A finished choice's assistant message: content null when there is no answer (only calls, or thinking never
    closed); reasoning_content for a reasoning model (null: it did not think) or thinking a declared format read."""
    shaped: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.no_answer else "")}
    if reply.reasoning_model or reply.thinking:
        # both names: LibreChat and the DeepSeek-style clients read reasoning_content, vLLM's and SGLang's newer
        # clients reasoning; Open WebUI either
        shaped["reasoning_content"] = shaped["reasoning"] = reply.thinking or None
    if reply.calls:
        shaped["tool_calls"] = [tool_call(call) for call in reply.calls]
    return shaped


def finish_reason(out: RequestOutput, called_tools: bool = False) -> str:
    """OpenAI's finish_reason: "length", "tool_calls" (a reply that ended by calling tools) or "stop"; and ours,
    "repetition" (the repetition guard ended a reply stuck in a loop)."""
    if out.finish_reason in ("length", "repetition"):
        return out.finish_reason
    return "tool_calls" if called_tools else "stop"


def usage(finals, prompt_tokens: int) -> dict:
    finals = list(finals)
    completion = sum(len(o.token_ids) for o in finals)
    cached = max((o.num_cached_tokens for o in finals), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def timings(out: RequestOutput) -> dict:
    """A finished sample's timings: ours (ttft_ms, tpot_ms, tokens_per_second, queue_ms) and llama.cpp server's
    names, which Open WebUI reads to show a reply's speed: prompt_n (tokens prefilled, the cached ones apart in
    cache_n), prompt_ms (queue to first token), predicted_n / predicted_ms (the generated tokens, first token to
    finish) and their per-token and per-second figures."""
    m = out.metrics or {}
    tpot, ttft, queue = m.get("tpot"), m.get("ttft"), m.get("queue_time")
    prompt_n = (m.get("prompt_tokens") or 0) - (m.get("cached_tokens") or 0)
    predicted_n = m.get("generated_tokens") or 0
    prompt_ms = ttft * 1000 if ttft is not None else None
    predicted_ms = tpot * (predicted_n - 1) * 1000 if tpot else 0.0
    per_second = None if not tpot else round(1 / tpot, 2)  # the decode rate, under both names
    return {"ttft_ms": _ms(ttft), "tpot_ms": _ms(tpot), "tokens_per_second": per_second, "queue_ms": _ms(queue),
            "cache_n": m.get("cached_tokens") or 0, "prompt_n": prompt_n, "prompt_ms": _round(prompt_ms),
            "prompt_per_token_ms": _round(prompt_ms / prompt_n) if prompt_ms and prompt_n else None,
            "prompt_per_second": _round(prompt_n / prompt_ms * 1000) if prompt_ms and prompt_n else None,
            "predicted_n": predicted_n, "predicted_ms": _round(predicted_ms),
            "predicted_per_token_ms": _ms(tpot), "predicted_per_second": per_second}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def chat_logprobs(items: list[TokenLogprob], tokenizer) -> dict:
    """OpenAI's chat logprobs object: {"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}."""
    return {"content": [_entry(tokenizer, i.token_id, i.logprob)
                        | {"top_logprobs": [_entry(tokenizer, t, lp) for t, lp in i.top]} for i in items]}


def completion_logprobs(items: list[TokenLogprob], tokenizer, prompt: list[int] | None = None,
                        prompt_logprobs: list[TokenLogprob] | None = None) -> dict:
    """OpenAI's completions logprobs object: {"tokens", "token_logprobs", "top_logprobs"}. With the prompt's
    (echo): its tokens first, the first one's logprob and top null (nothing comes before it)."""
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if prompt_logprobs is not None and prompt:
        tokens.append(_piece(tokenizer, prompt[0]))
        logprobs.append(None)
        tops.append(None)
    for item in (prompt_logprobs or []) + items:
        tokens.append(_piece(tokenizer, item.token_id))
        logprobs.append(item.logprob)
        tops.append({_piece(tokenizer, t): lp for t, lp in item.top})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops}


def _piece(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    piece = _piece(tokenizer, token_id)
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "id": token_id}
