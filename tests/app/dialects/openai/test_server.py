"""The OpenAI-compatible server, run by uvicorn on 127.0.0.1, driven by the real `openai` client and
raw HTTP: chat and completions (whole and streamed), usage with cached tokens, logprobs, errors in
OpenAI's shape, API keys, client disconnects, /metrics and /health."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.engine_helpers import wait_idle
from tests.helpers.threaded_api import openai_client, threaded_api

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(embedded_llm):
    with threaded_api(embedded_llm, MODEL, API_KEY) as served:
        yield served


@pytest.fixture()
def client(server):
    return openai_client(server[0], API_KEY)


def test_chat_completion_with_openai_client(client, server):
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 10 and reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.model_extra["timings"]["ttft_ms"] > 0
    again = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16)
    assert again.choices[0].message.content == reply.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache served the repeat
    # llama.cpp server's timing names, which Open WebUI reads for a reply's speed
    timings, usage = again.model_extra["timings"], again.usage
    assert timings["cache_n"] == usage.prompt_tokens_details.cached_tokens
    assert timings["prompt_n"] + timings["cache_n"] == usage.prompt_tokens
    assert timings["predicted_n"] == usage.completion_tokens and timings["predicted_per_second"] > 0
    assert timings["predicted_ms"] == pytest.approx(timings["predicted_per_token_ms"] * (timings["predicted_n"] - 1),
                                                    rel=0.01)
    assert timings["prompt_ms"] > 0 and timings["prompt_per_second"] > 0
    assert wait_idle(server[1])


def test_streamed_chat_deltas_join_to_the_answer(client, server):
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16,
                                                  stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    # the role comes with the first token, after prefill (as vLLM and OpenAI send it): clients' TTFT is true
    assert chunks[0].choices[0].delta.content and [c for c in chunks if c.choices][1].choices[0].delta.role is None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith(chunks[0].choices[0].delta.content)
    assert "Paris" in text
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # really streamed
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert wait_idle(server[1])


def test_completions_length_stop_and_n(client, server):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20,
                                        stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop" and " 7" not in stopped.choices[0].text
    many = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=1.0, seed=3, n=3,
                                     max_tokens=5)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert wait_idle(server[1])


def test_chat_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=4,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy picks the top token


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["quant"] == "none" and models[0].model_extra["memory"]["weights_bytes"] > 0
    assert models[0].model_extra["gguf_weights"] is None  # the dense conversion (the GGUF default: test_gguf_source)


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"top_logprobs": 99, "logprobs": True}, "top_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": 10**6}, "messages"),  # prompt + max_tokens beyond the context
])
def test_bad_input_is_400_naming_the_field(server, body, param):
    payload = {"model": MODEL, "messages": FRANCE} | body
    r = httpx.post(f"{server[0]}/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server[0]}/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_unknown_model_is_404(client):
    from openai import NotFoundError

    with pytest.raises(NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=FRANCE, max_tokens=2)
    assert info.value.body["param"] == "model"


def test_missing_or_wrong_api_key_is_401(server):
    from openai import AuthenticationError, OpenAI

    wrong = OpenAI(base_url=f"{server[0]}/v1", api_key="nope", max_retries=0)
    with pytest.raises(AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{server[0]}/v1/models").status_code == 401
    assert httpx.get(f"{server[0]}/health").status_code == 200  # health needs no key


def test_client_disconnect_aborts_and_frees_blocks(server):
    url, engine = server
    payload = {"model": MODEL, "messages": FRANCE, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        lines = 0
        for line in response.iter_lines():
            lines += bool(line)
            if lines >= 4:
                break  # hang up mid-stream
    assert wait_idle(engine), "the aborted request still holds KV blocks"
    assert engine.engine.stats().generated_tokens_total > 0


def test_metrics_in_prometheus_format(client, server):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    text = httpx.get(f"{server[0]}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    for name in ("kvforge_requests_admitted", "kvforge_requests_total", "kvforge_prompt_tokens_total",
                 "kvforge_cached_tokens_total", "kvforge_generated_tokens_total", "kvforge_ttft_seconds_bucket",
                 "kvforge_tpot_seconds_bucket", "kvforge_kv_blocks_used", "kvforge_kv_blocks_free",
                 "kvforge_requests_running", "kvforge_requests_waiting"):
        assert name in text, name


def test_full_queue_is_503_and_frees_on_close(server):
    from contextlib import ExitStack

    url, engine = server
    payload = {"model": MODEL, "messages": FRANCE, "max_tokens": 300, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=60) as http, ExitStack() as streams:
        for _ in range(8):  # the server under test allows 8 requests in flight
            response = streams.enter_context(http.stream("POST", f"{url}/v1/chat/completions", json=payload,
                                                         headers=headers))
            assert response.status_code == 200
        busy = httpx.post(f"{url}/v1/chat/completions", json=payload, headers=headers)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "queue_full"
        assert busy.headers["retry-after"] == "1"
    assert wait_idle(engine)
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers=headers)
    assert ok.status_code == 200


def test_seeded_sampling_is_reproducible(client):
    def ask():
        return client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=1.0, seed=42,
                                              max_tokens=12).choices[0].message.content

    assert ask() == ask()


def test_cors_is_closed_by_default(server):
    preflight = httpx.options(f"{server[0]}/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in {k.lower() for k in preflight.headers}
    r = httpx.get(f"{server[0]}/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}
