"""A vision-language model through `kvforge serve` (a tiny random Idefics3 / SmolVLM with SmolVLM's chat template, and
for the openai and ollama clients' chats and the next turn a tiny random Gemma 3 with Gemma's template too):
a picture through the openai client's chat and Responses APIs, the ollama client's images and the anthropic client's
image blocks, each reply equal to HF transformers' greedy one for the same conversation (its processor's own chat
template and pixels); the next turn of a chat about a picture read from the prefix cache without encoding it again;
pictures the server will not take refused with a 400 naming the field."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.server_process import ServeProcess
from tests.helpers.tiny_models import save_tiny_gemma3_vision, save_tiny_idefics3

MODEL = "tiny-vlm"
QUESTION = "What is in this picture?"
MAX_TOKENS = 16


def png(seed: int, height: int = 48, width: int = 64) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, embedded_path):
    path = tmp_path_factory.mktemp("tiny-vlm")
    model, processor = save_tiny_idefics3(path, embedded_path, seed=21)
    server = ServeProcess("--model", str(path), "--served-model-name", MODEL, "--dtype", "float32",
                          "--image-url-hosts", "localhost")
    yield server, model, processor
    server.stop()


@pytest.fixture(scope="module")
def gemma3_vlm(tmp_path_factory, embedded_path):
    path = tmp_path_factory.mktemp("tiny-gemma3-vlm")
    model, processor = save_tiny_gemma3_vision(path, embedded_path, seed=22)
    server = ServeProcess("--model", str(path), "--served-model-name", MODEL, "--dtype", "float32")
    yield server, model, processor
    server.stop()


FAMILIES = ["vlm", "gemma3_vlm"]  # the servers of both families


def hf_reply(model, processor, conversation: list[dict], pictures: list[bytes]) -> tuple[str, int]:
    """HF's greedy reply text to `conversation` (HF content parts) and its prompt's length."""
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in pictures]
    inputs = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    prompt_len = inputs["input_ids"].shape[1]
    return processor.tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True), prompt_len


ASKED = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


@pytest.mark.parametrize("family", FAMILIES)
def test_openai_chat_with_a_picture_answers_as_hf(request, family):
    from openai import OpenAI

    server, model, processor = request.getfixturevalue(family)
    picture = png(1)
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}},
                                     {"type": "text", "text": QUESTION}]}])
    text, prompt_len = hf_reply(model, processor, ASKED, [picture])
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_len


@pytest.mark.parametrize("family", FAMILIES)
def test_the_next_turn_reads_the_picture_from_the_cache_and_encodes_nothing(request, family):
    from openai import OpenAI

    server, model, processor = request.getfixturevalue(family)
    picture = png(2)
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}},
                                          {"type": "text", "text": QUESTION}]}]
    before = server.metric("images_encoded")
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=MAX_TOKENS, messages=first)
    assert server.metric("images_encoded") == before + 1
    answer = reply.choices[0].message.content
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And its colours?"}]
    again = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=MAX_TOKENS, messages=second)
    assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens - 16  # all but a block
    assert server.metric("images_encoded") == before + 1  # the picture's positions came from the cache
    conversation = [*ASKED, {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                    {"role": "user", "content": [{"type": "text", "text": "And its colours?"}]}]
    assert again.choices[0].message.content == hf_reply(model, processor, conversation, [picture])[0]


def test_responses_api_input_image_answers_as_hf(vlm):
    from openai import OpenAI

    server, model, processor = vlm
    picture = png(3)
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    response = client.responses.create(model=MODEL, temperature=0, max_output_tokens=MAX_TOKENS, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(picture), "detail": "auto"},
                                     {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == hf_reply(model, processor, ASKED, [picture])[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_ollama_client_images_answer_as_hf(request, family):
    import ollama

    server, model, processor = request.getfixturevalue(family)
    picture = png(4)
    client = ollama.Client(host=server.url)
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION, "images": [picture]}],
                        options={"temperature": 0, "num_predict": MAX_TOKENS})
    assert reply.message.content == hf_reply(model, processor, ASKED, [picture])[0]
    generated = client.generate(model=MODEL, prompt=QUESTION, images=[picture],
                                options={"temperature": 0, "num_predict": MAX_TOKENS})
    assert generated.response == reply.message.content
    assert "vision" in client.show(MODEL).capabilities


def test_anthropic_client_image_blocks_answer_as_hf(vlm):
    import anthropic

    server, model, processor = vlm
    picture = png(5)
    client = anthropic.Anthropic(base_url=server.url, api_key="unused")
    # (the anthropic client of 2026 has no sampling fields: temperature goes in extra_body)
    message = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(picture).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == hf_reply(model, processor, ASKED, [picture])[0]


def huge_png() -> bytes:
    """A small file whose canvas is 7000 x 7000 pixels (49 million)."""
    out = io.BytesIO()
    Image.new("1", (7000, 7000)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("url, why", [
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64,@@@@", "does not decode"),
    (data_url(b"not a picture at all"), "not a picture this server can read"),
    (data_url(huge_png()), "7000 x 7000 pixels"),
])
def test_pictures_the_server_will_not_take_are_400_naming_messages(vlm, url, why):
    server, _, _ = vlm
    body = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and why in error["message"], error


def test_too_many_pictures_and_a_low_detail_are_refused(vlm):
    server, _, _ = vlm
    part = {"type": "image_url", "image_url": {"url": data_url(png(6, 8, 8))}}
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [part] * 17}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "may carry 16" in response.json()["error"]["message"], response.text
    low = {"type": "image_url", "image_url": {"url": part["image_url"]["url"], "detail": "low"}}
    body["messages"] = [{"role": "user", "content": [low]}]
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "detail" in response.json()["error"]["message"], response.text
    counted = httpx.post(f"{server.url}/v1/tokenize", timeout=30, json={"model": MODEL, "messages": [
        {"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]}).json()
    assert counted["count"] > 16  # the picture's tiles' tokens, not one placeholder
    card = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]
    assert card["id"] == MODEL and card["input_modalities"] == ["text", "image"]
    assert server.metrics()["requests_running"] == 0


def test_a_session_keeps_its_pictures_across_turns_export_and_import(vlm):
    """The sessions API: a user message's picture is stored with it, rendered again in the next turn (read from the
    prefix cache: nothing encoded), served back, exported inside the file and imported into a new session; deleting
    the sessions deletes the picture."""
    server, model, processor = vlm
    picture = png(7)
    http = httpx.Client(base_url=server.url, timeout=120)
    session = http.post("/v1/sessions", json={"title": "picture"}).json()["id"]
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS, "stream": False}
    first = http.post(f"/v1/sessions/{session}/messages",
                      json={"content": QUESTION, "images": [data_url(picture)], **greedy}).json()
    answer = first["message"]["content"]
    assert answer == hf_reply(model, processor, ASKED, [picture])[0]
    digest = first["user"]["images"][0]
    assert http.get(f"/v1/sessions/{session}/pictures/{digest}").content == picture
    encoded = server.metric("images_encoded")
    second = http.post(f"/v1/sessions/{session}/messages", json={"content": "And its colours?", **greedy}).json()
    conversation = [*ASKED, {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                    {"role": "user", "content": [{"type": "text", "text": "And its colours?"}]}]
    assert second["message"]["content"] == hf_reply(model, processor, conversation, [picture])[0]
    assert server.metric("images_encoded") == encoded  # the picture's positions came from the prefix cache
    exported = http.get(f"/v1/sessions/{session}/export").json()
    assert exported["messages"][0]["images"] == ["data:;base64," + base64.b64encode(picture).decode()]
    imported = http.post("/v1/sessions/import", json=exported).json()
    assert imported["messages"][0]["images"] == [digest]
    assert http.delete(f"/v1/sessions/{session}").status_code in (200, 204)
    assert http.get(f"/v1/sessions/{imported['id']}/pictures/{digest}").content == picture  # still shown there
    assert http.delete(f"/v1/sessions/{imported['id']}").status_code in (200, 204)
    again = http.post("/v1/sessions", json={"title": "other"}).json()["id"]
    missing = http.get(f"/v1/sessions/{again}/pictures/{digest}")
    assert missing.status_code == 404, missing.text
    refused = http.post(f"/v1/sessions/{again}/messages",
                        json={"content": "x", "images": ["https://example.com/a.png"], **greedy})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "images", refused.text


@pytest.fixture(scope="module")
def picture_site():
    """A local web server: /photo.png a picture, /moved a redirect to it, /big more bytes than a picture may take."""
    from kvforge.app.generate.pictures import MAX_IMAGE_BYTES

    pages = {"/photo.png": png(8), "/big": b"\0" * (MAX_IMAGE_BYTES + 1)}

    class Pages(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/photo.png")
                self.end_headers()
                return
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    site = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield site.server_address[1], pages["/photo.png"]
    site.shutdown()


def test_an_image_url_on_an_allowed_host_is_fetched_and_others_are_not(vlm, picture_site):
    """--image-url-hosts localhost: a picture at http://localhost:... is fetched (the reply HF's for it); the same
    address by IP, a redirect and a body over the size limit are refused with a 400 naming messages."""
    from openai import OpenAI

    server, model, processor = vlm
    port, picture = picture_site
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"http://localhost:{port}/photo.png"}},
                                     {"type": "text", "text": QUESTION}]}])
    assert reply.choices[0].message.content == hf_reply(model, processor, ASKED, [picture])[0]
    for url, why in ((f"http://127.0.0.1:{port}/photo.png", "'127.0.0.1' is not one it allows"),
                     (f"http://localhost:{port}/moved", "302"),
                     (f"http://localhost:{port}/big", "20 MiB at most")):
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}]}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and why in error["message"], error
