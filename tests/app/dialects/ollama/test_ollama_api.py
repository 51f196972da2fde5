"""Ollama's API through a real `kvforge serve` started as README command 1 starts it (the embedded model in its
default configuration), driven by the official `ollama` client. A request means the same through Ollama's API
as through OpenAI's: greedy replies, tool calls and constrained outputs are compared with /v1/chat/completions'
and /v1/completions' for the same request."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from tests.app.test_agent_api import ASK_WEATHER, JSON_HELLO, MODEL, TIME, WEATHER, Person

GREEDY = {"temperature": 0, "num_predict": 24}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(readme_server):  # tests/app/conftest.py
    return readme_server


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=300)


def openai_chat(server, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_chat_whole_and_streamed_equal_the_openai_reply(client, server):
    whole = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    expected = openai_chat(server, messages=ASK, temperature=0, max_tokens=24)
    assert whole.message.content == expected["message"]["content"]
    assert whole.eval_count <= 24 and whole.prompt_eval_count > 5
    assert whole.total_duration >= whole.eval_duration > 0 and whole.prompt_eval_duration > 0
    parts = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == whole.eval_count
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert client.chat(model=f"{MODEL}:latest", messages=ASK, options=GREEDY).message.content == whole.message.content


def test_generate_templated_raw_and_continued(client, server):
    whole = client.generate(model=MODEL, prompt="What is the capital of France?", options=GREEDY)
    assert whole.response == openai_chat(server, messages=ASK, temperature=0, max_tokens=24)["message"]["content"]
    tokens = httpx.post(f"{server.url}/v1/tokenize", json={"messages": ASK, "add_generation_prompt": True},
                        timeout=60).json()["tokens"]
    assert whole.context[:len(tokens)] == tokens and len(whole.context) == len(tokens) + whole.eval_count
    streamed = list(client.generate(model=MODEL, prompt="What is the capital of France?", options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == whole.response and streamed[-1].context == whole.context
    more = client.generate(model=MODEL, prompt="And of Italy?", context=whole.context, options=GREEDY)
    assert more.context[:len(whole.context)] == whole.context and more.response

    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY)
    completion = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 24}, timeout=300).json()
    assert raw.response == completion["choices"][0]["text"]
    loaded = client.generate(model=MODEL, prompt="")
    assert loaded.done and loaded.done_reason == "load"


def test_format_schema_and_json(client):
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                        format=Person.model_json_schema(), options={"temperature": 0, "num_predict": 120})
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), Person.model_json_schema())
    reply = client.generate(model=MODEL, prompt=JSON_HELLO, format="json",
                            options={"temperature": 0, "num_predict": 200})
    assert reply.done_reason == "stop" and isinstance(json.loads(reply.response), dict)


def test_tool_calls_and_a_round_trip_equal_the_openai_replies(client, server):
    """Ollama reads calls from free replies (OpenAI's tool_choice auto); a conversation with a call and its
    result (Ollama names the function, not the call) renders as OpenAI's does. Each Ollama request runs twice and
    the second is compared: then both dialects' replies start from the same cached prefix (a prompt computed cold and
    one continued from cached blocks may differ at a near-tie in bf16, where the CPU computes in it)."""
    sent = [ollama.Tool.model_validate(t).model_dump(exclude_none=True) for t in (WEATHER, TIME)]  # as the client
    for _ in range(2):
        reply = client.chat(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], options={"temperature": 0,
                                                                                              "num_predict": 60})
    expected = openai_chat(server, messages=ASK_WEATHER, tools=sent, temperature=0, max_tokens=60)
    calls = [(c.function.name, dict(c.function.arguments)) for c in reply.message.tool_calls or []]
    assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in expected["message"].get("tool_calls") or []]
    assert reply.message.content == (expected["message"]["content"] or "")
    streamed = list(client.chat(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], stream=True,
                                options={"temperature": 0, "num_predict": 60}))
    assert [(c.function.name, dict(c.function.arguments)) for p in streamed for c in p.message.tool_calls or []] \
        == calls

    arguments = {"city": "Paris", "unit": "celsius"}
    history = ASK_WEATHER + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": arguments}}]},
        {"role": "tool", "tool_name": "get_weather", "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    for _ in range(2):
        answer = client.chat(model=MODEL, messages=history, tools=[WEATHER], options={"temperature": 0,
                                                                                      "num_predict": 30})
    openai_history = ASK_WEATHER + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": history[-1]["content"]}]
    expected = openai_chat(server, messages=openai_history, tools=sent[:1], temperature=0, max_tokens=30)
    assert answer.message.content == (expected["message"]["content"] or "")


def test_a_raw_prompt_cannot_switch_thinking(server):
    response = httpx.post(f"{server.url}/api/generate", json={"model": MODEL, "prompt": "Hi", "raw": True,
                                                             "think": False, "stream": False}, timeout=60)
    assert response.status_code == 400 and "think: a raw prompt" in response.json()["error"]


def test_num_ctx_bounds_the_request(client):
    first = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    window = first.prompt_eval_count + 5
    cut = client.chat(model=MODEL, messages=ASK, options={"temperature": 0, "num_predict": 50, "num_ctx": window})
    assert cut.done_reason == "length" and cut.eval_count == 5
    to_the_end = client.chat(model=MODEL, messages=ASK, options={"temperature": 0, "num_predict": -1,
                                                                "num_ctx": window})
    assert to_the_end.eval_count <= 5
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=MODEL, messages=ASK, options={"num_ctx": first.prompt_eval_count})
    assert refused.value.status_code == 400 and refused.value.error.startswith("options.num_ctx:")


def test_logprobs(client):
    reply = client.chat(model=MODEL, messages=ASK, options={"temperature": 0, "num_predict": 4}, logprobs=True,
                        top_logprobs=2)
    assert len(reply.logprobs) == reply.eval_count
    for entry in reply.logprobs:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_tags_show_ps_version(client, server):
    names = [m.model for m in client.list().models]
    assert f"{MODEL}:latest" in names  # as Ollama lists names: with a tag (Open WebUI tells the connections apart)
    shown = client.show(MODEL)
    assert shown.details.family == "llama" and shown.details.format == "gguf"
    assert shown.details.parameter_size == "135M" and shown.details.quantization_level == "Q4_1"
    assert shown.capabilities == ["completion", "tools"]  # a generative model's, as Ollama's; Copilot needs tools
    # VS Code Copilot reads the context at model_info["<general.architecture>.context_length"]
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == client.ps().models[0].context_length
    assert shown.modelinfo["kvforge.trained_context_length"] >= shown.modelinfo["llama.context_length"]
    assert client.show(f"{MODEL}:latest").details == shown.details
    assert "<|im_start|>" in shown.template
    # ChatML has no tool syntax: kvforge's tool rendering is noted in a Jinja comment, where litellm looks for "tools"
    import jinja2

    assert "tools" in shown.template and "{#-" in shown.template
    rendered = jinja2.Environment().from_string(shown.template).render(messages=ASK, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    running = client.ps().models
    assert [m.model for m in running] == [f"{MODEL}:latest"] and running[0].size > 0 and running[0].context_length > 0
    listed = next(m for m in client.list().models if m.model == f"{MODEL}:latest")
    assert running[0].digest == listed.digest and running[0].details == listed.details == shown.details
    version = httpx.get(f"{server.url}/api/version", timeout=30).json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 6, 4)  # VS Code Copilot's Ollama provider needs 0.6.4
    # the model under its older name, `name` (litellm's get_model_info sends it), as Ollama still takes it
    by_name = httpx.post(f"{server.url}/api/show", json={"name": MODEL}, timeout=30)
    assert by_name.status_code == 200, by_name.text
    assert by_name.json()["details"] == shown.details.model_dump() and by_name.json()["template"] == shown.template
    missing = httpx.post(f"{server.url}/api/show", json={}, timeout=30)
    assert missing.status_code == 400 and "model" in missing.json()["error"]


@pytest.mark.parametrize(("request_fields", "status", "field"), [
    ({"model": "no-such-model"}, 404, "model"),
    ({"options": {"num_gpu": 1}}, 400, "options"),
    ({"options": {"mirostat": 2}}, 400, "options"),
    ({"options": {"temperature": -1}}, 400, "options.temperature"),
    ({"options": {"num_predict": 0}}, 400, "options"),
    ({"keep_alive": "soon"}, 400, "keep_alive"),
    ({"think": True}, 400, "think"),
    ({"format": {"type": "no-such-type"}}, 400, "format"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400, "takes no images"),
    ({"messages": [{"role": "assistant", "content": "hi", "images": ["aGk="]}]}, 400, "messages.0.images"),
    ({"unknown_field": 1}, 400, "unknown_field"),
])
def test_bad_requests_get_ollama_errors_naming_the_field(server, request_fields, status, field):
    body = {"model": MODEL, "messages": ASK, "stream": False, **request_fields}
    response = httpx.post(f"{server.url}/api/chat", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error, str) and field in error
    client = ollama.Client(host=server.url)
    with pytest.raises(ollama.ResponseError) as raised:  # the client reads it as Ollama's
        client.chat(**{k: v for k, v in body.items() if k != "unknown_field"}) if "unknown_field" not in body \
            else client._request_raw("POST", "/api/chat", json=body)
    assert raised.value.status_code == status and raised.value.error == error


def test_a_reply_with_calls_in_the_clients_own_types(embedded_path):
    """The 135M model does not call tools unforced (Ollama has no tool_choice), so a reply with calls is read
    here, as the route reads one, and checked against the client's own types, whole and as stream deltas."""
    from kvforge.app.dialects.ollama.routes import part_message, whole_message
    from kvforge.app.dialects.openai.messages import ChatMessage
    from kvforge.app.dialects.openai.tools import ToolFields
    from kvforge.app.generate.chat_output import ChoiceReader, read_whole
    from kvforge.app.generate.chat_request import plan_conversation
    from kvforge.core.tokenizer import Tokenizer

    plan = plan_conversation(Tokenizer(embedded_path), [ChatMessage(**ASK_WEATHER[0])],
                             ToolFields(tools=[WEATHER, TIME]))
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')
    whole = ollama.Message.model_validate(whole_message(read_whole(plan, text)))
    assert whole.content == "Let me check."
    assert [(c.function.name, dict(c.function.arguments)) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]
    reader = ChoiceReader(plan)
    parts = [p for i in range(0, len(text), 5) for p in reader.feed(text[i:i + 5])] + reader.finish()
    streamed = [ollama.Message.model_validate(part_message(p)) for p in parts]
    assert [c.function for m in streamed for c in m.tool_calls or []] == [c.function for c in whole.tool_calls]
    assert "".join(m.content for m in streamed).strip() == whole.content
