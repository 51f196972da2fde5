"""Reasoning through a real `kvforge serve`, driven by the official openai SDK: a "thinking" variant of the embedded
model (its weights; a DeepSeek-R1-style template ending the generation prompt with `<think>\\n`, and `<think>` /
`</think>` as single, non-special tokens) separates the think block into `reasoning_content`, whole and streamed,
and opens a JSON response_format only after `</think>`.

No reasoning model is available offline, so two of SmolLM2's unused added tokens are renamed to the markers. The
weights never learnt `</think>`, so requests that need the block closed push it with logit_bias. `<filename>` /
`<file_sep>` are renamed, not e.g. `<repo_name>` / `<reponame>`: after `<repo_name>` the first step is the model's
least sure (its top token leads `</think>` by under 2 logits, later ones by far more), so a bias closes the block at
the first step or never, while after `<filename>` it writes a few sure tokens first and a bias can close it there."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.helpers.server_process import ServeProcess
from tests.helpers.thinking_model import END_ID, START_ID, thinking_model

MODEL = "thinker"
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "color": {"type": "string", "maxLength": 12}},
          "required": ["name", "color"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
# Read from the fp32 greedy logits: the top token leads `</think>` by over 13 at each step up to "2 + 3\n", then by
# ~11.9; a bias in between (12 to 13 all close it there) gives a few tokens of reasoning, then `</think>`
CLOSE_SOON = {str(END_ID): 12.5}
CLOSE_NOW = {str(END_ID): 100}  # `</think>` first: empty reasoning


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, embedded_path):
    return thinking_model(tmp_path_factory.mktemp("thinker") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # fp32 pinned: CLOSE_SOON's margins (~0.6 logits) are read from fp32 logits, bf16's rounding could move them
    process = ServeProcess("--model", str(model_dir), "--served-model-name", MODEL, "--dtype", "float32",
                           "--data-dir", str(tmp_path_factory.mktemp("data")), "--no-ui", "--no-persist-kv",
                           "--kv-cache-gb", "0.25")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def reasoning_of(message_or_delta) -> str | None:
    """The SDK has no reasoning_content field: it lands in the pydantic model's extras. The chat route sends the
    thinking under both names clients read (reasoning_content: LibreChat, DeepSeek-style; reasoning: vLLM's and
    SGLang's newer clients), always alike."""
    extras = message_or_delta.model_extra or {}
    assert extras.get("reasoning") == extras.get("reasoning_content")
    return extras.get("reasoning_content")


def test_a_replayed_thinking_is_taken_under_either_name():
    from kvforge.app.dialects.openai.messages import ChatMessage

    for name in ("reasoning_content", "reasoning"):
        message = ChatMessage.model_validate({"role": "assistant", "content": "4", name: "2 + 2 is 4"})
        assert message.template_dict()["reasoning_content"] == "2 + 2 is 4"
    with pytest.raises(ValueError, match="reasoning: only on assistant messages"):
        ChatMessage.model_validate({"role": "user", "content": "hi", "reasoning": "no"})


def chat(client, **fields):
    return client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, **fields)


def streamed(client, **fields) -> tuple[str | None, str | None, str]:
    """(reasoning, content, finish_reason) of a streamed reply: the deltas joined, None where none came."""
    reasoning, content, finish = [], [], None
    for chunk in chat(client, stream=True, **fields):
        for choice in chunk.choices:
            reasoning.append(reasoning_of(choice.delta) or "")
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(reasoning) or None, "".join(content) or None, finish


def test_the_markers_are_single_visible_tokens(tokenizer):
    assert tokenizer.encode("</think>", add_special_tokens=False) == [END_ID]
    assert tokenizer.encode("<think>", add_special_tokens=False) == [START_ID]
    assert tokenizer.decode([START_ID, END_ID], skip_special_tokens=True) == "<think></think>"
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_an_unclosed_think_block_is_all_reasoning(client):
    reply = chat(client, max_tokens=12)
    message = reply.choices[0].message
    assert "reasoning_content" in message.model_extra  # a reasoning model's reply always has the field
    assert reasoning_of(message)  # the model writes text after `<think>\n`: its reasoning
    assert message.content is None  # the block never closed: no answer
    assert "</think>" not in reasoning_of(message) and "<think>" not in reasoning_of(message)


@pytest.mark.parametrize("bias", [CLOSE_NOW, CLOSE_SOON], ids=["close-now", "close-soon"])
def test_json_response_format_opens_after_the_think_block(client, tokenizer, bias):
    reply = chat(client, max_tokens=64, logit_bias=bias, response_format=JSON_FORMAT)
    choice = reply.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.finish_reason == "stop"  # the JSON ended it, not max_tokens
    # the reasoning is what the model writes before `</think>` without the constraint: the same greedy prompt and
    # bias as a raw completion (the constraint holds only after the marker, so the two agree up to it)
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True, return_dict=False)
    raw = client.completions.create(model=MODEL, prompt=list(prompt), temperature=0, max_tokens=12, logit_bias=bias)
    assert reply.usage.prompt_tokens == len(prompt)
    before, marker, _ = raw.choices[0].text.partition("</think>")
    assert marker, f"the bias did not close the think block: {raw.choices[0].text!r}"
    assert reasoning_of(choice.message) == (before.lstrip("\n") or None)
    if bias is CLOSE_SOON:  # the case this bias was chosen for: some reasoning, then the answer
        assert reasoning_of(choice.message)


@pytest.mark.parametrize("fields", [
    {"max_tokens": 12},
    {"max_tokens": 64, "logit_bias": CLOSE_SOON, "response_format": JSON_FORMAT},
], ids=["unclosed", "reasoning-then-json"])
def test_streamed_deltas_join_to_the_whole_reply(client, fields):
    whole = chat(client, **fields).choices[0]
    assert streamed(client, **fields) == (reasoning_of(whole.message), whole.message.content, whole.finish_reason)


def test_chat_template_kwargs_switch_thinking_off(client, tokenizer):
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")  # the block closed in the prompt
    # no bias: the template closed the block, so the constraint holds from the first token
    reply = chat(client, max_tokens=64, response_format=JSON_FORMAT, extra_body=no_thinking)
    message = reply.choices[0].message
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert reasoning_of(message) is None and reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


# ---- the sessions API: a reply's thinking stored apart from its answer ------------------------------------------


def session_turn(server, session_id: str, **fields) -> tuple[list[dict], dict]:
    """Post a message to a session, streamed: (the delta events, the done event)."""
    import httpx

    events = []
    with httpx.stream("POST", f"{server.url}/v1/sessions/{session_id}/messages", timeout=300,
                      json={"stream": True, **fields}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
    assert events[-1]["type"] == "done", events[-1]
    return [e for e in events if e["type"] == "delta"], events[-1]


def test_a_session_stores_the_reasoning_apart_and_renders_the_history(client, server, tokenizer):
    import httpx

    created = httpx.post(f"{server.url}/v1/sessions", json={"sampling": {"temperature": 0}}, timeout=30)
    assert created.status_code == 200, (created.status_code, created.text)
    session = created.json()
    deltas, done = session_turn(server, session["id"], content=QUESTION[0]["content"], max_tokens=24,
                                logit_bias=CLOSE_SOON)
    # the same reply as the chat route's, split the same way
    expected = chat(client, max_tokens=24, logit_bias=CLOSE_SOON).choices[0].message
    assert reasoning_of(expected) and expected.content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning_of(expected)
    assert "".join(d.get("content", "") for d in deltas) == expected.content
    assert all(len(d) == 2 for d in deltas)  # each delta carries one of the two
    message = done["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning_of(expected), expected.content)
    stored = httpx.get(f"{server.url}/v1/sessions/{session['id']}", timeout=30).json()["messages"]
    assert stored[1] == message

    # an unclosed think block: all reasoning, an empty answer, whole (not streamed) too
    response = httpx.post(f"{server.url}/v1/sessions/{session['id']}/messages", timeout=300,
                          json={"content": "And 4 + 4?", "max_tokens": 8, "stream": False})
    assert response.status_code == 200, (response.status_code, response.text)
    reply = response.json()
    assert reply["message"]["reasoning_content"] and reply["message"]["content"] == ""
    assert "</think>" not in reply["message"]["reasoning_content"]

    # the next turn renders the history through the template (this one ignores reasoning_content)
    _, third = session_turn(server, session["id"], content="Thanks.", max_tokens=4)
    history = [{"role": "user", "content": QUESTION[0]["content"]}, {"role": "assistant", "content": expected.content},
               {"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": ""},
               {"role": "user", "content": "Thanks."}]
    prompt = tokenizer.apply_chat_template(history, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert third["usage"]["prompt_tokens"] == len(prompt)



# ---- Ollama's API: think ------------------------------------------------------------------------------------------


def test_ollama_think_separates_the_thinking_and_switches_it_off(client, server):
    """Ollama's `think` reads as the OpenAI route's reasoning split (true, or left out) and enable_thinking (false);
    /api/show lists the model as thinking."""
    import ollama

    ollama_client = ollama.Client(host=server.url, timeout=300)
    assert "thinking" in ollama_client.show(MODEL).capabilities
    expected = chat(client, max_tokens=12).choices[0].message
    for think in (True, None):
        reply = ollama_client.chat(model=MODEL, messages=QUESTION, think=think,
                                   options={"temperature": 0, "num_predict": 12})
        assert reply.message.thinking == reasoning_of(expected) and reply.message.content == ""
    parts = list(ollama_client.chat(model=MODEL, messages=QUESTION, think=True, stream=True,
                                    options={"temperature": 0, "num_predict": 12}))
    assert "".join(p.message.thinking or "" for p in parts) == reasoning_of(expected)
    off = ollama_client.chat(model=MODEL, messages=QUESTION, think=False, options={"temperature": 0, "num_predict": 12})
    expected = chat(client, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.message.thinking is None and off.message.content == expected.choices[0].message.content
    generated = ollama_client.generate(model=MODEL, prompt=QUESTION[0]["content"], think=True,
                                       options={"temperature": 0, "num_predict": 12})
    assert generated.thinking == reasoning_of(chat(client, max_tokens=12).choices[0].message)


# ---- Anthropic's Messages API: thinking blocks ---------------------------------------------------------------------


def test_anthropic_thinking_blocks(client, server):
    """A reasoning model's thinking as a thinking block, whole and streamed (Anthropic's API has no logit_bias, so
    the block never closes here: all of the reply is thinking); thinking disabled is the template's enable_thinking
    false."""
    import anthropic

    messages_client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    expected = chat(client, max_tokens=12).choices[0].message
    fields = dict(model=MODEL, max_tokens=12, messages=QUESTION, thinking={"type": "adaptive"},
                  extra_body={"temperature": 0})
    message = messages_client.messages.create(**fields)
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", reasoning_of(expected))]
    assert message.stop_reason == "max_tokens"
    with messages_client.messages.stream(**fields) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    off = messages_client.messages.create(**(fields | {"thinking": {"type": "disabled"}}))
    expected = chat(client, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == expected.choices[0].message.content


# ---- OpenAI's Responses API: a reasoning item -----------------------------------------------------------------------


def test_responses_reasoning_item(client):
    """A reasoning model's thinking is a reasoning item (reasoning_text content), whole and streamed (the Responses
    API has no logit_bias: the block stays open, the reply is cut, all thinking); an input's reasoning item goes
    back to the template as the assistant's reasoning_content, as the chat route renders it."""
    fields = dict(model=MODEL, input=QUESTION[0]["content"], temperature=0, max_output_tokens=12)
    expected = reasoning_of(chat(client, max_tokens=12).choices[0].message)
    response = client.responses.create(**fields)
    assert response.status == "incomplete" and [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == expected
    events = list(client.responses.create(**fields, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == expected
    follow_up = {"role": "user", "content": "And 3 + 4?"}
    history = [QUESTION[0], *[item.model_dump(exclude_none=True) for item in response.output], follow_up]
    again = client.responses.create(model=MODEL, input=history, temperature=0, max_output_tokens=1)
    rendered = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=1, messages=[
        QUESTION[0], {"role": "assistant", "content": "", "reasoning_content": expected}, follow_up])
    assert again.usage.input_tokens == rendered.usage.prompt_tokens
