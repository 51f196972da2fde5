"""A second real model through the server: `kvforge serve --model <Gemma 3 270M Q4_K_M GGUF>` with its defaults
(served from the file's own blocks), chatted with through the official openai client. The file carries no chat
template: the Gemma family's (core/chat_templates.py) renders the turns and <end_of_turn> ends the reply."""

from __future__ import annotations

import pytest

from kvforge.core import LLM, SamplingParams
from tests.helpers.server_process import ServeProcess

QUESTION = [{"role": "user", "content": "Name a large city in France."}]


@pytest.fixture(scope="module")
def gemma_server(gemma_gguf_path):
    server = ServeProcess("--model", str(gemma_gguf_path), "--served-model-name", "gemma", start_timeout=600)
    yield server
    server.stop()


def test_chat_with_a_gguf_that_has_no_template(gemma_server, gemma_gguf_path):
    from openai import OpenAI

    client = OpenAI(base_url=f"{gemma_server.url}/v1", api_key="unused")
    reply = client.chat.completions.create(model="gemma", messages=QUESTION, temperature=0, max_tokens=24)
    text = reply.choices[0].message.content
    assert text.strip() and "<end_of_turn>" not in text and "<start_of_turn>" not in text
    assert reply.choices[0].finish_reason in ("stop", "length")
    offline = LLM(str(gemma_gguf_path), progress=False, kv_cache_bytes=64 << 20)  # the same defaults offline
    assert offline.engine.config.quant == "gguf"
    prompt = offline.tokenizer.apply_chat_template(QUESTION)
    assert offline.tokenizer.decode(prompt[:6], skip_special_tokens=False).startswith("<bos><start_of_turn>user\n")
    same = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    assert reply.usage.prompt_tokens == len(prompt)
    assert text == same.text
