"""OpenAI's response fields from the engine's outputs: finish_reason, usage (with cached tokens), logprobs objects,
and kvforge's extra `timings` (ttft_ms, tpot_ms, tokens_per_second, queue_ms); the other dialects and the sessions API
reuse them where their shapes match."""

from __future__ import annotations

from kvforge.core.output import RequestOutput, TokenLogprob


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
    m = out.metrics or {}
    tpot = m.get("tpot")
    return {"ttft_ms": None if m.get("ttft") is None else round(m["ttft"] * 1000, 2),
            "tpot_ms": None if tpot is None else round(tpot * 1000, 2),
            "tokens_per_second": None if not tpot else round(1 / tpot, 2),
            "queue_ms": None if m.get("queue_time") is None else round(m["queue_time"] * 1000, 2)}


def format_logprobs(items: list[TokenLogprob], chat: bool, tokenizer) -> dict:
    """OpenAI's logprobs objects: chat {"content": [...]}, completions {"tokens", "token_logprobs", ...}."""

    def entry(token_id: int, logprob: float) -> dict:
        piece = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "id": token_id}

    if chat:
        return {"content": [entry(i.token_id, i.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in i.top]}
                            for i in items]}
    return {"tokens": [entry(i.token_id, i.logprob)["token"] for i in items],
            "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [{entry(t, lp)["token"]: lp for t, lp in i.top} for i in items]}
