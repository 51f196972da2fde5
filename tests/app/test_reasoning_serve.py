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
import os
from pathlib import Path

import jsonschema
import pytest

from tests.helpers.server_process import ServeProcess

START_ID, END_ID = 6, 5  # SmolLM2's <filename>, <file_sep>: renamed <think>, </think>
TEMPLATE = (  # ChatML; DeepSeek-R1's open think block, or Qwen3's closed empty one when enable_thinking is false
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
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


def thinking_model(directory: Path) -> Path:
    """The embedded model's directory with the think markers renamed into its tokenizer and TEMPLATE."""
    from kvforge.core.loader import resolve_model

    source = Path(resolve_model(None))
    directory.mkdir()
    (directory / "config.json").write_text((source / "config.json").read_text())
    (directory / "tokenizer_config.json").write_text((source / "tokenizer_config.json").read_text())
    os.symlink(source / "model.safetensors", directory / "model.safetensors")  # 0.5 GB: not copied
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    renames = {START_ID: "<think>", END_ID: "</think>"}
    for token in tokenizer["added_tokens"]:
        if token["id"] in renames:
            vocab = tokenizer["model"]["vocab"]
            assert vocab.pop(token["content"]) == token["id"]
            token["content"] = renames[token["id"]]
            vocab[token["content"]] = token["id"]
            token["special"] = False  # decoding keeps them: the reader must see `</think>` in the text
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return directory


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
    """The SDK has no reasoning_content field: it lands in the pydantic model's extras."""
    return (message_or_delta.model_extra or {}).get("reasoning_content")


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
