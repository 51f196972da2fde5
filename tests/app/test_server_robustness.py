"""The server under hostile and heavy traffic, over real HTTP on 127.0.0.1: hypothesis-fuzzed request
bodies never get a 5xx and every error comes in OpenAI's shape; 64 concurrent streaming clients all
finish, and afterwards the KV pool drains to zero and the server still answers. The load runs on a tiny
random-weight model (the embedded tokenizer and chat template): what is loaded is the server's concurrency and
bookkeeping, not the weights, and its short steps let the clients turn over many requests in a short time."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.app.http.threaded_server import serve_in_thread
from kvforge.app.server import create_app
from kvforge.core import AsyncEngine
from tests.helpers.api_checks import assert_openai_error, lax_number
from tests.helpers.engine_helpers import wait_idle

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "robust-key-456"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS_CAP = 4  # the fuzzer never lets the model run long


@pytest.fixture(scope="module")
def engine(embedded_llm):
    engine = AsyncEngine(embedded_llm.engine)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def fuzz_server(engine):
    """Small queue, and a small default max_tokens so bodies without a limit stay short too."""
    app = create_app(engine, MODEL, api_key=API_KEY, max_pending=16, default_max_tokens=MAX_TOKENS_CAP)
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def load_engine(tmp_path_factory, embedded_path):
    from kvforge.core import LLM
    from tests.helpers.tiny_models import save_tiny_model

    model = tmp_path_factory.mktemp("load-model") / "tiny-llama"
    save_tiny_model("llama3", model, embedded_path, seed=0, chat_template=True)
    engine = AsyncEngine(LLM(str(model), progress=False, dtype="float32", kv_cache_bytes=64 << 20).engine)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def load_server(load_engine):
    with serve_in_thread(create_app(load_engine, MODEL, api_key=API_KEY, max_pending=128)) as url:
        yield url


# --- strategies --------------------------------------------------------------------------------------

SCALARS = (st.none() | st.booleans()
           | st.integers(min_value=-(2**70), max_value=2**70)
           | st.sampled_from([0, 1, -1, 2, 20, 21, 64, 65, 2**31, 2**63, -(2**63), 10**30])
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 1e308, -1e308, 1e-320, float("nan"), float("inf")])
           | st.text(max_size=12)
           | st.sampled_from(["", " ", "\x00", "\u00e9\u4e2d\U0001f600", "null", "1", "-1", "1e9", "nan", "true"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=10)

ROLES = st.sampled_from(["system", "user", "assistant", "developer", "tool"])
WILD_ROLES = st.sampled_from(["function", "wizard", "", "USER"]) | JSON
TEXT = st.text(max_size=30) | st.sampled_from(["", "Hi!", "\u00e9\u4e2d\U0001f600", "<|im_end|>", "\x00\n\t"])
PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "junk"])},
                                       optional={"text": TEXT | JSON}), max_size=3)
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": TEXT | PARTS | st.none()}),
                          min_size=1, max_size=3)
WILD_MESSAGES = st.lists(st.fixed_dictionaries({}, optional={"role": ROLES | WILD_ROLES,
                                                             "content": TEXT | PARTS | JSON, "name": JSON})
                         | JSON, max_size=4) | JSON
VALID_PROMPT = TEXT.filter(bool) | st.lists(st.integers(min_value=0, max_value=40000), min_size=1, max_size=8)
WILD_PROMPT = (st.lists(st.integers(min_value=-5, max_value=60000), max_size=8)
               | st.lists(st.integers(min_value=-(2**64), max_value=2**64), max_size=3) | JSON)

# mostly valid values (edges included), so most bodies reach the engine
FIELDS = {
    "model": st.sampled_from([MODEL, ""]),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "max_tokens": st.integers(min_value=1, max_value=MAX_TOKENS_CAP),
    "max_completion_tokens": st.integers(min_value=1, max_value=MAX_TOKENS_CAP),
    "temperature": st.sampled_from([0, 0.0, 1e-9, 0.7, 2]) | st.floats(min_value=0, max_value=2),
    "top_p": st.sampled_from([1e-9, 0.5, 1]) | st.floats(min_value=0.01, max_value=1),
    "n": st.integers(min_value=1, max_value=2),
    "stop": TEXT.filter(bool) | st.lists(TEXT.filter(bool), max_size=5),
    "seed": st.integers(min_value=-(2**70), max_value=2**70),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "top_k": st.sampled_from([-1, 0, 1, 50, 10**9, 2**63 - 1, 2**63]),
    "min_p": st.floats(min_value=0, max_value=1),
    "repetition_penalty": st.sampled_from([1e-9, 0.5, 1.0, 1.3, 1e6, 1e308]),
    "min_tokens": st.integers(min_value=0, max_value=MAX_TOKENS_CAP + 2),
    "ignore_eos": st.booleans(),
}
CHAT_FIELDS = {**FIELDS, "logprobs": st.booleans(), "top_logprobs": st.integers(min_value=0, max_value=20)}
COMPLETION_FIELDS = {**FIELDS, "logprobs": st.integers(min_value=0, max_value=20), "echo": st.booleans()}
JUNK_KEYS = st.sampled_from(["", "foo", "tools", "user", "response_format", "\u2603", "messages ", "Max_Tokens"])


def _tame(body: dict) -> dict:
    """Keep whatever a fuzzed body says, except limits that would make the model run long or wide."""
    for key, cap in (("max_tokens", MAX_TOKENS_CAP), ("max_completion_tokens", MAX_TOKENS_CAP),
                     ("min_tokens", MAX_TOKENS_CAP), ("n", 2)):
        number = lax_number(body.get(key))
        if number is not None and (math.isnan(number) or number > cap):
            body[key] = cap
    return body


@st.composite
def bodies(draw, fields: dict, required: str, valid, wild) -> dict:
    """A valid body with optional fields, then 0-2 of its fields corrupted (any JSON, or dropped)."""
    body = {"model": MODEL, required: draw(valid)}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=6)):
        body[name] = draw(fields[name])
    for name in draw(st.lists(st.sampled_from(sorted(fields) + [required]), unique=True, max_size=2)):
        if draw(st.integers(0, 9)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(wild) if name == required else draw(JSON)
    for key in draw(st.lists(JUNK_KEYS, max_size=2)):
        body[key] = draw(JSON)
    return _tame(body)


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code != 200:
        assert_openai_error(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", response.text[-500:]
        for event in events[:-1]:
            json.loads(event.removeprefix("data: "))
    else:
        assert response.json()["choices"], response.text


@pytest.fixture(scope="module")
def http(fuzz_server):
    with httpx.Client(base_url=fuzz_server, headers=HEADERS, timeout=60) as client:
        yield client


FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@FUZZ
@given(body=bodies(CHAT_FIELDS, "messages", VALID_MESSAGES, WILD_MESSAGES))
def test_fuzzed_chat_bodies_never_5xx(http, body):
    _check(http.post("/v1/chat/completions", content=json.dumps(body).encode(),
                     headers={"content-type": "application/json"}))


@FUZZ
@given(body=bodies(COMPLETION_FIELDS, "prompt", VALID_PROMPT, WILD_PROMPT))
def test_fuzzed_completion_bodies_never_5xx(http, body):
    _check(http.post("/v1/completions", content=json.dumps(body).encode(),
                     headers={"content-type": "application/json"}))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("content, content_type", [
    (b"{not json", "application/json"),
    (b"", "application/json"),
    (b"[]", "application/json"),
    (b'[{"role": "user", "content": "hi"}]', "application/json"),
    (b"null", "application/json"),
    (b'"a string"', "application/json"),
    (b"42", "application/json"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"', "application/json"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "max_tokens": 2}', "text/plain"),
    (b"messages=hi&prompt=hi", "application/x-www-form-urlencoded"),
    (b"\xff\xfe\x00garbage", "application/json"),
    (b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
     "application/json"),
])
def test_raw_malformed_payloads(http, path, content, content_type):
    _check(http.post(path, content=content, headers={"content-type": content_type}))


def test_fuzzing_leaves_nothing_behind(http, engine):
    assert wait_idle(engine, timeout=30)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


# --- load ----------------------------------------------------------------------------------------------

CLIENTS = 64
TOPICS = ["the sea", "a red bicycle", "prime numbers", "autumn leaves", "the moon landing", "bread baking",
          "a lost cat", "volcanoes", "chess openings", "the water cycle", "jazz", "honeybees", "trains",
          "glaciers", "a rainy Monday", "origami"]


async def _one_stream(client: httpx.AsyncClient, i: int, j: int) -> dict:
    topic = TOPICS[(i * 3 + j) % len(TOPICS)]
    payload = {"model": MODEL, "stream": True, "max_tokens": 8 + (i + j) % 9, "temperature": 0.7, "seed": i,
               "messages": [{"role": "user", "content": f"Client {i}, request {j}: write one line about {topic}."
                                                        + " Be vivid." * (i % 4)}]}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "body": (await response.aread()).decode()}
        events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]
                if json.loads(e[6:])["choices"]]
    return {"status": 200, "done": bool(events) and events[-1] == "data: [DONE]",
            "finish": [f for f in finishes if f is not None]}


LOAD_SECONDS = 10  # every client keeps streaming requests, one after another, for this long
MAX_REQUESTS_PER_CLIENT = 40  # bounded even on a fast machine


async def _client(url: str, i: int, deadline: float) -> list[dict]:
    limits = httpx.Limits(max_connections=2)
    results = []
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=40, limits=limits) as client:
        while not results or (time.monotonic() < deadline and len(results) < MAX_REQUESTS_PER_CLIENT):
            results.append(await _one_stream(client, i, len(results)))
    return results


async def _load(url: str) -> list[dict]:
    deadline = time.monotonic() + LOAD_SECONDS
    results = await asyncio.wait_for(asyncio.gather(*(_client(url, i, deadline) for i in range(CLIENTS))),
                                     timeout=LOAD_SECONDS + 60)
    return [r for per_client in results for r in per_client]


def test_64_concurrent_streaming_clients(load_server, load_engine):
    start = time.monotonic()
    results = asyncio.run(_load(load_server))
    assert time.monotonic() - start >= LOAD_SECONDS and len(results) > CLIENTS
    failed = [r for r in results if r["status"] != 200]
    assert not failed, failed[:3]
    assert all(r["done"] for r in results), "a stream did not end with data: [DONE]"
    assert all(len(r["finish"]) == 1 and r["finish"][0] in ("stop", "length") for r in results)
    assert wait_idle(load_engine, timeout=30), f"KV blocks still in use: {load_engine.engine.block_pool.num_used}"
    r = httpx.post(f"{load_server}/v1/chat/completions", headers=HEADERS, timeout=60,
                   json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi!"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
