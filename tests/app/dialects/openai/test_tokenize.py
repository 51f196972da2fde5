"""/v1/tokenize and /v1/detokenize (vLLM's shapes) over real HTTP (uvicorn on 127.0.0.1, the embedded model):
the ids are the engine tokenizer's own (a prompt's, and a conversation's through the chat template), they
decode back to the text, the counts and the context length are right, bad ids and bodies get a 400 naming
the field, an unknown model 404, and the routes sit behind the API key like every other."""

from __future__ import annotations

import httpx
import pytest

from kvforge.app.http.threaded_server import serve_in_thread
from kvforge.app.server import create_app
from kvforge.core import AsyncEngine
from tests.helpers.api_checks import assert_openai_error

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "tokenize-key-654"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TEXT = "Tokenizers split text into pieces: h\u00e9llo, \u4e2d\u6587, \U0001f600!"
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(embedded_llm):
    engine = AsyncEngine(embedded_llm.engine)
    with serve_in_thread(create_app(engine, MODEL, api_key=API_KEY, max_pending=8)) as url:
        yield url
    engine.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers=HEADERS, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(embedded_llm):
    return embedded_llm.engine.tokenizer


def test_prompt_tokens_are_the_tokenizers_own_and_decode_back(http, tokenizer, embedded_llm):
    r = http.post("/v1/tokenize", json={"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(TEXT) and body["count"] == len(body["tokens"]) > 5
    assert body["max_model_len"] == embedded_llm.engine.max_model_len
    assert body["token_strs"] is None
    back = http.post("/v1/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_token_strs_are_the_vocabulary_entries(http, tokenizer):
    body = http.post("/v1/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.hf.convert_ids_to_tokens(body["tokens"])
    assert "".join(body["token_strs"]).replace("\u0120", " ") == "Hello world"  # byte-level: a space is \u0120


def test_add_special_tokens_is_honoured(http, tokenizer):
    without = http.post("/v1/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert without == tokenizer.hf.encode(TEXT, add_special_tokens=False)


def test_messages_tokens_are_the_chat_templates(http, tokenizer):
    body = http.post("/v1/tokenize", json={"messages": CONVERSATION}).json()
    assert body["tokens"] == tokenizer.apply_chat_template(CONVERSATION) and body["count"] == len(body["tokens"])
    closed = http.post("/v1/tokenize", json={"messages": CONVERSATION, "add_generation_prompt": False}).json()
    assert closed["tokens"] == tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert closed["count"] < body["count"]  # no assistant header at the end
    text = http.post("/v1/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text.count("<|im_start|>") == len(CONVERSATION) + 1  # special tokens are kept


def test_messages_count_matches_the_chat_routes_prompt_tokens(http):
    counted = http.post("/v1/tokenize", json={"model": MODEL, "messages": CONVERSATION}).json()["count"]
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CONVERSATION, "max_tokens": 1})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == counted


@pytest.mark.parametrize("path, body, param", [
    ("/v1/detokenize", {"tokens": [1, 2, 10**6]}, "tokens"),
    ("/v1/detokenize", {"tokens": [-1]}, "tokens"),
    ("/v1/detokenize", {"tokens": "hello"}, "tokens"),
    ("/v1/tokenize", {}, "prompt"),
    ("/v1/tokenize", {"prompt": "a", "messages": CONVERSATION}, "messages"),
    ("/v1/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/v1/tokenize", {"prompt": "a", "max_tokens": 3}, "max_tokens"),
    ("/v1/tokenize", {"messages": CONVERSATION, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ("/v1/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
])
def test_bad_bodies_are_400_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert_openai_error(r)
    assert r.json()["error"]["param"] == param


def test_out_of_vocabulary_id_is_named(http, tokenizer):
    r = http.post("/v1/detokenize", json={"tokens": [0, tokenizer.vocab_size]})
    assert r.status_code == 400 and str(tokenizer.vocab_size) in r.json()["error"]["message"]
    assert http.post("/v1/detokenize", json={"tokens": [tokenizer.vocab_size - 1]}).status_code == 200


@pytest.mark.parametrize("path, body", [("/v1/tokenize", {"prompt": "hi"}), ("/v1/detokenize", {"tokens": [1]})])
def test_unknown_model_is_404(http, path, body):
    r = http.post(path, json={"model": "gpt-17", **body})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path, body", [("/v1/tokenize", {"prompt": "hi"}), ("/v1/detokenize", {"tokens": [1]}),
                                        ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}),
                                        ("/tokenizer_info", None)])
def test_the_api_key_is_required(server, path, body):
    if body is None:  # a GET
        assert httpx.get(f"{server}{path}").status_code == 401
        assert httpx.get(f"{server}{path}", headers=HEADERS).status_code == 200
        return
    keyless = httpx.post(f"{server}{path}", json=body)
    assert keyless.status_code == 401
    assert_openai_error(keyless)
    wrong = httpx.post(f"{server}{path}", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert httpx.post(f"{server}{path}", json=body, headers=HEADERS).status_code == 200


def test_lm_evals_remote_tokenizer_finds_what_it_asks_for(http, tokenizer):
    """lm-eval's `tokenizer_backend=remote` (its RemoteTokenizer): GET /tokenizer_info with an eos_token and the chat
    template, then POST /tokenize {"prompt", "add_special_tokens": false} -> tokens and /detokenize -> prompt, all at
    the server's root (vLLM's paths)."""
    info = http.get("/tokenizer_info").json()
    hf = tokenizer.hf
    assert info["eos_token"] == hf.eos_token and info["bos_token"] == hf.bos_token
    assert info["chat_template"] == hf.chat_template and info["model_max_length"] > 0
    ids = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert ids == tokenizer.encode(TEXT, add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == TEXT
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos[0] in tokenizer.eos_token_ids
