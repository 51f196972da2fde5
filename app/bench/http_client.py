"""A streamed chat request as the HTTP benches (serve, peers --http) send it, timed by the client."""

from __future__ import annotations

import json
import time


async def stream_chat(client, model: str, messages: list[dict], max_tokens: int, extra: dict | None = None) -> dict:
    """POST /v1/chat/completions with stream and usage on `client` (an httpx.AsyncClient with the server's base
    URL), greedy, EOS ignored. Returns the token counts (the usage chunk's, else one per content delta), TTFT at the
    first delta with content, TPOT (last - first content delta) / (tokens - 1) (a delta can carry several tokens),
    the whole latency; TTFT / TPOT None where there is nothing to time. An HTTP error status or an error event in
    the stream raises RuntimeError."""
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    start, times, usage = time.perf_counter(), [], {}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status_code}: {body[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    tokens = usage.get("completion_tokens", len(times))
    return {"tokens": tokens, "prompt_tokens": usage.get("prompt_tokens"),
            "ttft": times[0] - start if times else None,
            "tpot": (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None,
            "latency": end - start}


def wait_until_serving(process, url: str, deadline: float, path: str = "/v1/models") -> None:
    """Until GET `path` answers 200 (the model is loaded). RuntimeError when the server process exits first or the
    monotonic `deadline` passes."""
    import httpx

    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited (code {process.returncode}) before it answered")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not answer {path} in time")
        try:
            if httpx.get(f"{url}{path}", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
