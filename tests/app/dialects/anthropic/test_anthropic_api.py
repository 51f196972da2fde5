"""Anthropic's Messages API through a real `kvforge serve` started as README command 1 starts it (the embedded model
in its default configuration), driven by the official `anthropic` client. A request means the same as through
OpenAI's API: greedy replies, forced tool calls and token counts are compared with /v1/chat/completions' and
/v1/tokenize's for the same conversation. (The anthropic client of 2026 has no sampling fields: `temperature`
goes in extra_body, as older clients sent it.)"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.app.test_agent_api import MODEL, WEATHER, Person

GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
                "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def server(readme_server):  # tests/app/conftest.py
    return readme_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def openai_chat(server, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_create_and_stream_equal_the_openai_reply(client, server):
    system = "You answer in one short sentence."
    expected = openai_chat(server, messages=[{"role": "system", "content": system}, *ASK], temperature=0,
                           max_tokens=24)
    message = client.messages.create(model=MODEL, max_tokens=24, system=system, messages=ASK, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == expected["choices"][0]["message"]["content"]
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[expected["choices"][0]["finish_reason"]]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected["usage"]["prompt_tokens"]
    assert usage.cache_read_input_tokens > 0  # the OpenAI request before it left the prompt in the prefix cache
    assert usage.output_tokens == expected["usage"]["completion_tokens"]

    with client.messages.stream(model=MODEL, max_tokens=24, system=system, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text and final.content[0].text == text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens


def test_stop_sequences_say_which_one_stopped_it(client):
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    word = whole.split()[2]
    message = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, stop_sequences=["\u2603", word],
                                     extra_body=GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert message.content[0].text == whole[:whole.index(word)]


def test_forced_tool_use_round_trip(client, server):
    """tool_choice any -> a tool_use block whose input validates (the grammar), the same call as OpenAI's
    `required`; its tool_result -> an answer in words."""
    message = client.messages.create(model=MODEL, max_tokens=100, messages=[
        {"role": "user", "content": "What is the weather like in Paris today?"}], tools=[WEATHER_TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    call = message.content[0]
    jsonschema.validate(call.input, WEATHER_TOOL["input_schema"])
    expected = openai_chat(server, messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
                           tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0,
                           max_tokens=100)["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (call.name, call.input) == (expected["name"], json.loads(expected["arguments"]))
    with client.messages.stream(model=MODEL, max_tokens=100, messages=[
            {"role": "user", "content": "What is the weather like in Paris today?"}], tools=[WEATHER_TOOL],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", call.name, call.input)]

    answer = client.messages.create(model=MODEL, max_tokens=30, tools=[WEATHER_TOOL], tool_choice={"type": "none"},
                                    extra_body=GREEDY, messages=[
        {"role": "user", "content": "What is the weather like in Paris today?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": json.dumps({"temperature": 21, "sky": "sunny"})}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].text


def test_output_format_and_count_tokens(client, server):
    message = client.messages.create(
        model=MODEL, max_tokens=120, messages=[{"role": "user", "content": "Invent a person."}], extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": Person.model_json_schema()}})
    jsonschema.validate(json.loads(message.content[0].text), Person.model_json_schema())
    assert message.stop_reason == "end_turn"

    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK, tools=[WEATHER_TOOL])
    conversation = [{"role": "system", "content": "Be brief."}, *ASK]
    tokenized = httpx.post(f"{server.url}/v1/tokenize", json={
        "messages": conversation, "tools": [WEATHER], "add_generation_prompt": True}, timeout=60).json()
    assert counted.input_tokens == tokenized["count"]


@pytest.mark.parametrize(("fields", "status", "named"), [
    ({"model": "claude-no-such-model"}, 404, "claude-no-such-model"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"temperature": 1.5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "aGk="}}]}]}, 400, "takes no images"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
     400, "media_type"),
    ({"messages": [*ASK, {"role": "assistant", "content": "Paris is"}]}, 400, "prefill"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "server tool"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, 400, "budget_tokens"),
    ({"output_config": {"effort": "extreme"}}, 400, "effort"),  # accepted with no effect, but only Anthropic's values
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, 400, "mcp_servers"),
    ({"stop_sequences": [""]}, 400, "stop_sequences"),
    ({"unknown_field": 1}, 400, "unknown_field"),
])
def test_bad_requests_get_anthropic_errors_naming_the_field(server, fields, status, named):
    body = {"model": MODEL, "max_tokens": 8, "messages": ASK, **fields}
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert named in error["error"]["message"]
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as raised:  # the client reads it as Anthropic's
        client.post("/v1/messages", body=body, cast_to=dict)
    assert raised.value.status_code == status and raised.value.body == error


# ---- what Claude Code sends: the SDK's beta namespace, probes, token-count bursts, context editing ----------------

CONTEXT_BETA = ["context-management-2025-06-27", "interleaved-thinking-2025-05-14"]


def tool_history(turns: int) -> list[dict]:
    """A conversation in which the assistant called get_weather `turns` times and got each result back."""
    history: list[dict] = [{"role": "user", "content": "What is the weather in these cities?"}]
    for i in range(turns):
        history.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"I should look up city {i}.", "signature": ""},
            {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather",
             "input": {"city": f"City {i}", "unit": "celsius"}}]})
        history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                     "content": f"City {i}: sunny, {20 + i} degrees, light wind "
                                                                "from the west, no rain expected today."}]})
    history[-1]["content"].append({"type": "text", "text": "Summarise."})
    return history


def test_claude_codes_probe_and_count_token_bursts(client, server):
    """Claude Code probes the server with HEAD /, then counts tokens in bursts while it works."""
    from concurrent.futures import ThreadPoolExecutor

    assert httpx.head(server.url, timeout=30).status_code == 200
    assert httpx.get(server.url, timeout=30).text == "kvforge is running"  # no UI here: Ollama's "is running"

    def count(_):
        return client.messages.count_tokens(model=MODEL, messages=tool_history(2), tools=[WEATHER_TOOL]).input_tokens

    with ThreadPoolExecutor(16) as pool:
        counts = list(pool.map(count, range(32)))
    assert len(set(counts)) == 1 and counts[0] > 50


def test_context_editing_through_the_beta_namespace(client, server):
    """The SDK's beta namespace (what Claude Code uses) posts to /v1/messages?beta=true with anthropic-beta headers and
    context_management: edits that do not reach their trigger change nothing and say so; clearing tool uses past
    a low trigger replaces the old results (fewer input tokens, reported as applied); count_tokens counts the
    edited conversation too."""
    history = tool_history(3)
    plain = client.beta.messages.create(model=MODEL, max_tokens=4, messages=history, tools=[WEATHER_TOOL],
                                        betas=CONTEXT_BETA, extra_body=GREEDY)
    keep_all = client.beta.messages.create(
        model=MODEL, max_tokens=4, messages=history, tools=[WEATHER_TOOL], betas=CONTEXT_BETA, extra_body=GREEDY,
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"},
                                      {"type": "clear_tool_uses_20250919"}]})  # the default trigger: 100k tokens
    assert keep_all.context_management.applied_edits == []
    assert keep_all.usage.input_tokens + keep_all.usage.cache_read_input_tokens == \
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    clearing = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
                          {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
                           "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": True}]}
    cleared = client.beta.messages.create(model=MODEL, max_tokens=4, messages=history, tools=[WEATHER_TOOL],
                                          betas=CONTEXT_BETA, extra_body=GREEDY, context_management=clearing)
    thinking, tools = [edit.model_dump() for edit in cleared.context_management.applied_edits]
    assert thinking["type"] == "clear_thinking_20251015" and thinking["cleared_thinking_turns"] == 2
    assert tools["type"] == "clear_tool_uses_20250919" and tools["cleared_tool_uses"] == 2
    total = cleared.usage.input_tokens + cleared.usage.cache_read_input_tokens
    assert tools["cleared_input_tokens"] > 20
    assert total == plain.usage.input_tokens + plain.usage.cache_read_input_tokens - tools["cleared_input_tokens"] \
        - thinking["cleared_input_tokens"]
    counted = client.beta.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER_TOOL],
                                                betas=CONTEXT_BETA, context_management=clearing)
    assert counted.input_tokens == total
    with client.beta.messages.stream(model=MODEL, max_tokens=4, messages=history, tools=[WEATHER_TOOL],
                                     betas=CONTEXT_BETA, extra_body=GREEDY, context_management=clearing) as stream:
        final = stream.get_final_message()
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total
    bad = httpx.post(f"{server.url}/v1/messages?beta=true", timeout=30, json={
        "model": MODEL, "max_tokens": 4, "messages": history,
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"},
                                          {"type": "clear_thinking_20251015"}]}})
    assert bad.status_code == 400 and "clear_thinking_20251015 comes first" in bad.json()["error"]["message"]


def test_a_request_shaped_as_claude_codes(client, server):
    """What Claude Code 2.1 sends on every turn (its request shape, with our own small texts): the beta namespace
    with its beta headers, a system message among the messages (beta mid-conversation-system: folded into the user
    turn it follows, as chat templates alternate turns), thinking adaptive, context_management, output_config.effort
    (accepted, no effect: no such control here), metadata.user_id, tools, and max_tokens 32000 -- an upper bound, cut
    to what the 8192-token context leaves. Read until the reply's first content (the greedy reply to this prompt
    runs on toward that bound: ~2.5 minutes of the suite), then the stream is closed as a client that leaves."""
    betas = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27",
             "mid-conversation-system-2026-04-07", "effort-2025-11-24"]
    user = [{"type": "text", "text": "<system-reminder>\nToday's date is 2026-12-06.\n</system-reminder>"},
            {"type": "text", "text": "Say hello in one word.", "cache_control": {"type": "ephemeral"}}]
    reminder = "Available agent types: claude (the default)."
    fields = dict(model=MODEL, system=[{"type": "text", "text": "You are a coding agent."}], tools=[WEATHER_TOOL],
                  betas=betas)
    with client.beta.messages.stream(
            **fields, max_tokens=32000, messages=[{"role": "user", "content": user},
                                                  {"role": "system", "content": reminder}],
            thinking={"type": "adaptive"}, output_config={"effort": "high"},
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            metadata={"user_id": '{"device_id": "d", "session_id": "s"}'}, extra_body=GREEDY) as stream:
        started = content = None
        for event in stream:
            if event.type == "message_start":
                started = event.message
            elif event.type == "content_block_delta":
                content = event.delta
                break
    assert started is not None and content is not None
    folded = [{"role": "user", "content": [*user, {"type": "text", "text": "\n\n" + reminder}]}]
    as_one_turn = client.beta.messages.count_tokens(model=MODEL, messages=folded, system=fields["system"],
                                                    tools=[WEATHER_TOOL], betas=betas).input_tokens
    assert started.usage.input_tokens + started.usage.cache_read_input_tokens == as_one_turn
