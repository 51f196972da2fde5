"""A picture in the browser chat, in headless Chromium against a real `kvforge serve` of a tiny random vision model
(Idefics3 / SmolVLM, tests/helpers/tiny_models.py): attached in the chat box (Gradio's multimodal input), its
thumbnail shown in the history, the reply HF transformers' greedy one for the same conversation, and the picture kept
with the conversation (shown again after a reload, in the export file)."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.server_process import readme_serve
from tests.helpers.tiny_models import save_tiny_idefics3
from tests.ui.ui_helpers import chat_messages, set_slider, wait_reply

TIMEOUT_MS = 120_000
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def vlm_server(browser, tmp_path_factory, embedded_path):  # after the browser check: a missing browser skips
    path = tmp_path_factory.mktemp("tiny-vlm-ui")
    model, processor = save_tiny_idefics3(path, embedded_path, seed=31)
    server = readme_serve(tmp_path_factory.mktemp("vlm-data"), "--model", str(path), "--dtype", "float32")
    yield server, model, processor
    server.stop()


def test_a_picture_attached_in_the_chat_box_is_answered_shown_and_kept(browser, vlm_server, tmp_path):
    server, model, processor = vlm_server
    pixels = np.random.default_rng(3).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    picture = tmp_path / "photo.png"
    Image.fromarray(pixels).save(picture)
    # the server's reply is greedy (temperature 0 set below): HF's for the same conversation
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(picture).convert("RGB")]], return_tensors="pt",
                       add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    try:
        page.goto(server.url)
        page.wait_for_selector("#message textarea")
        set_slider(page, "temperature", 0)
        set_slider(page, "max-tokens", 16)
        page.locator("#message input[type=file]").set_input_files(str(picture))
        page.wait_for_selector("#message img")  # the attachment's preview in the chat box
        page.fill("#message textarea", QUESTION)
        page.press("#message textarea", "Enter")
        page.wait_for_function("document.querySelectorAll('#chat [data-testid=bot]').length > 0")
        reply = wait_reply(page, server)
        assert reply.strip() == expected.strip()
        page.wait_for_selector("#chat [data-testid=user] img")  # the picture's thumbnail in the history
        assert page.locator("#message img").count() == 0  # the chat box cleared

        page.reload()
        page.wait_for_selector("#chat [data-testid=user] img")  # kept with the conversation
        assert chat_messages(page)[-1][1].strip() == expected.strip()
        sessions = httpx.get(f"{server.url}/v1/sessions", timeout=30).json()["data"]
        exported = httpx.get(f"{server.url}/v1/sessions/{sessions[0]['id']}/export", timeout=30).json()
        sent = base64.b64decode(exported["messages"][0]["images"][0].split(",", 1)[1])
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(sent)).convert("RGB")), pixels)
    finally:
        context.close()
