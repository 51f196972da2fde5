"""The served model's sampling defaults through the APIs, on a real `kvforge serve` started as README command 1 starts
it (the embedded SmolLM2 Q4_1, which decodes greedily by default: core/generation_defaults.py): a request that leaves
a field out samples exactly as one that sends the model's default (same seed, same tokens), through the official
`openai` client, Ollama's API and the sessions API; the repetition guard on request; and the settings file's per-model
defaults (--model-sampling) reaching the engine's configuration."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvforge.app.models.factory import engine_config, spec_from_settings
from kvforge.app.settings import resolve
from kvforge.core.repetition import MIN_SPAN
from tests.app.test_agent_api import MODEL

STORY = [{"role": "user", "content": "Write a short poem about the sea."}]
EMBEDDED_DEFAULTS = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(readme_server):  # tests/app/conftest.py
    return readme_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)


def chat(client, **fields) -> tuple[str, str]:
    choice = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=20, **fields).choices[0]
    return choice.message.content, choice.finish_reason


def test_the_model_card_names_the_defaults(server):
    card = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    assert card["sampling_defaults"] == EMBEDDED_DEFAULTS
    assert card["sampling_defaults_source"] == "kvforge bench defaults (embedded Q4_1)"
    # the context served, where clients look for it (vLLM's max_model_len; context_length: LM Studio, OpenRouter)
    served = httpx.get(f"{server.url}/api/ps", timeout=30).json()["models"][0]["context_length"]
    assert card["max_model_len"] == card["context_length"] == served == 8192


def test_left_out_fields_take_the_models_defaults(client, server):
    implicit = chat(client, seed=11)
    assert implicit == chat(client, seed=11, **EMBEDDED_DEFAULTS)
    # the neutral settings sample differently from the same seed (what the request got before model defaults)
    assert implicit != chat(client, seed=11, temperature=1.0, top_p=1.0)
    assert chat(client, seed=11, top_p=0.5) == implicit  # a field given keeps the other defaults
    # Ollama's options: left out, the same defaults
    ollama = httpx.post(f"{server.url}/api/chat", json={"model": MODEL, "messages": STORY, "stream": False,
                                                        "options": {"seed": 11, "num_predict": 20}}, timeout=300)
    assert ollama.json()["message"]["content"] == implicit[0]


def test_a_sessions_reply_takes_the_models_defaults_under_its_own(client, server):
    http = httpx.Client(base_url=server.url, timeout=300)
    session = http.post("/v1/sessions", json={}).json()
    reply = http.post(f"/v1/sessions/{session['id']}/messages",
                      json={"content": STORY[0]["content"], "stream": False, "seed": 11, "max_tokens": 20}).json()
    assert reply["message"]["content"] == chat(client, seed=11)[0]
    # a conversation's own sampling settings go over the model's
    hot = http.post("/v1/sessions", json={"sampling": {"temperature": 1.0}}).json()
    reply = http.post(f"/v1/sessions/{hot['id']}/messages",
                      json={"content": STORY[0]["content"], "stream": False, "max_tokens": 20, "seed": 5}).json()
    assert reply["message"]["content"] == chat(client, temperature=1.0, seed=5)[0]


def test_the_repetition_guard_ends_a_loop(client):
    completion = client.completions.create(model=MODEL, prompt="1, 2, 1, 2, 1, 2, 1, 2,", max_tokens=80,
                                           temperature=0, extra_body={"repetition_guard": True})
    assert completion.choices[0].finish_reason == "repetition"
    assert completion.usage.completion_tokens == MIN_SPAN
    plain = client.completions.create(model=MODEL, prompt="1, 2, 1, 2, 1, 2, 1, 2,", max_tokens=MIN_SPAN,
                                      temperature=0)
    assert plain.choices[0].text == completion.choices[0].text
    bad = httpx.post(f"{client.base_url}chat/completions", json={"model": MODEL, "messages": STORY,
                                                                "repetition_guard": "maybe"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_guard"


def test_the_settings_files_defaults_per_model(tmp_path):
    config = tmp_path / "kvforge.toml"
    config.write_text('[model_sampling."SmolLM2-135M-Instruct"]\ntemperature = 0.3\ntop_k = 40\n'
                      '[model_sampling."other.gguf"]\ntemperature = 1.0\n')
    settings = resolve(type("Args", (), {"config": str(config)})(), environ={})
    assert engine_config(spec_from_settings(settings), settings).sampling_defaults == {"temperature": 0.3, "top_k": 40}
    served_as = spec_from_settings(settings, served_name="other.gguf")  # by the name it is served under too
    assert engine_config(served_as, settings).sampling_defaults == {"temperature": 1.0}
    config.write_text('[model_sampling."SmolLM2-135M-Instruct"]\ntemperature = -1\n')
    with pytest.raises(ValueError, match=r"--model-sampling: 'SmolLM2-135M-Instruct': temperature must be"):
        resolve(type("Args", (), {"config": str(config)})(), environ={})
    with pytest.raises(ValueError, match="unknown fields seed"):
        resolve(type("Args", (), {"config": None})(), environ={"KVFORGE_MODEL_SAMPLING": '{"m": {"seed": 1}}'})


def test_a_reply_without_max_tokens_may_use_the_rest_of_the_context(server):
    """As OpenAI, vLLM and Ollama: no max_tokens (aider sends none for its long edits) and no --default-max-tokens
    (README command 1) lets a reply run until the model or the context ends it -- here past 512 tokens, the cap
    there was; the stream is left early (the request is aborted)."""
    body = {"model": MODEL, "prompt": "1, 2, 3,", "ignore_eos": True, "stream": True, "logprobs": 0}
    generated = 0
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                logprobs = json.loads(line[6:])["choices"][0]["logprobs"]
                generated += len(logprobs["token_logprobs"]) if logprobs else 0
            if generated > 600:
                break
    assert generated > 600
