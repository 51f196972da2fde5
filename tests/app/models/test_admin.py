"""Model management without a restart: load / swap / unload through the admin API, in-flight requests
finishing first, paths confined to the models directory, a failed load keeping the old model."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest
import torch

from kvforge.app.http.threaded_server import serve_in_thread
from kvforge.app.models.factory import default_engine_factory
from kvforge.app.models.host import ModelHost
from kvforge.app.models.spec import ModelSpec
from kvforge.app.server import create_app
from kvforge.core import AsyncEngine

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, embedded_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("models")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=256,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_path / name, root / "tiny-llama" / name)
    return root


@pytest.fixture(scope="module")
def server(embedded_llm, models_dir):
    host = ModelHost(default_engine_factory, ModelSpec(served_name=MODEL), AsyncEngine(embedded_llm.engine),
                     models_dir)
    with serve_in_thread(create_app(host)) as url:
        yield url, host
    host.close()


def stream_in_background(url: str, host: ModelHost, **fields) -> tuple[threading.Thread, dict]:
    """A 40-token streamed completion on a thread, returned once the server counts it in flight; its
    SSE lines land in done["lines"] when it ends."""
    done: dict = {}
    payload = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True, **fields}

    def long_stream():
        with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=120) as r:
            done["lines"] = [line for line in r.iter_lines() if line]

    streamer = threading.Thread(target=long_stream)
    streamer.start()
    while host.in_flight == 0:
        time.sleep(0.01)
    return streamer, done


def test_swap_waits_for_in_flight_requests_then_serves_the_new_model(server):
    url, host = server
    assert MODEL in httpx.get(f"{url}/admin/models").json()["available"]
    streamer, done = stream_in_background(url, host, model=MODEL)
    r = httpx.post(f"{url}/admin/models/load", json={"model": "tiny-llama"}, timeout=120)
    assert r.status_code == 200, r.text
    streamer.join(timeout=120)
    assert done["lines"][-1] == "data: [DONE]"
    assert any('"finish_reason": "length"' in line for line in done["lines"])  # it ran to the end first
    # the loaded model first; the others of the models directory follow, loaded on demand when a request names them
    assert [(m["id"], m["loaded"]) for m in httpx.get(f"{url}/v1/models").json()["data"]][0] == ("tiny-llama", True)
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(f"{url}/v1/completions", json={"model": "no-such-model", "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 404  # (the embedded model's name would load it on demand: test_models_on_demand)


@pytest.mark.parametrize("model, fragment", [("../../etc", "outside"), ("no-such-model", "not found"),
                                             ("/etc", "outside")])
def test_paths_stay_inside_the_models_directory(server, model, fragment):
    url, _ = server
    r = httpx.post(f"{url}/admin/models/load", json={"model": model})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]


def test_failed_load_keeps_the_old_model(server):
    url, host = server
    before = host.name
    r = httpx.post(f"{url}/admin/models/load", json={"model": "tiny-llama", "quant": "no-such-plugin"}, timeout=60)
    assert r.status_code == 400 and "no-such-plugin" in r.json()["error"]["message"]
    assert host.name == before
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_unload_then_load_the_embedded_model_again(server):
    url, _ = server
    assert httpx.post(f"{url}/admin/models/unload").json() == {"loaded": None}
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_model"
    assert not any(m["loaded"] for m in httpx.get(f"{url}/v1/models").json()["data"])
    r = httpx.post(f"{url}/admin/models/load", json={"model": "embedded", "dtype": "bfloat16"}, timeout=120)
    assert r.status_code == 200 and r.json()["loaded"]["dtype"] == "bfloat16"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3,
                                                  "temperature": 0})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]


def test_quant_swap_with_a_request_in_flight(server, models_dir):
    """The request in flight finishes on the old model; the next one runs on the new quant plugin, and
    /v1/models shows the plugin, its options and the smaller weights."""
    from kvforge.app.quantize.rtn_writer import write_rtn_checkpoint

    url, host = server
    write_rtn_checkpoint(models_dir / "tiny-llama", models_dir / "tiny-llama-gptq", method="gptq", sym=False)
    r = httpx.post(f"{url}/admin/models/load", json={"model": "tiny-llama"}, timeout=120)
    assert r.status_code == 200, r.text
    loaded = r.json()["loaded"]
    dense_bytes = loaded["memory"]["weights_bytes"]
    gpus = [] if not torch.cuda.is_available() else [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert [g["device"] for g in loaded["memory"]["gpus"]] == gpus  # VRAM per device (none on a CPU machine)
    assert (loaded["device"], loaded["kernels"], loaded["cuda_graphs"]) == ("cpu", "torch", False)
    assert loaded["gguf_weights"] is None  # a checkpoint directory: no GGUF blocks to copy or map
    for body, quant in (({"model": "tiny-llama", "quant": "bnb-nf4"}, "bnb-nf4"),
                        ({"model": "tiny-llama-gptq"}, "gptq")):  # a GPTQ checkpoint picks its plugin
        streamer, done = stream_in_background(url, host)
        r = httpx.post(f"{url}/admin/models/load", json=body, timeout=120)
        assert r.status_code == 200, r.text
        streamer.join(timeout=120)
        assert any('"finish_reason": "length"' in line for line in done["lines"])  # it ran to the end first
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["quant"] == quant and card["quant_options"], card
        assert card["memory"]["weights_bytes"] < dense_bytes, card
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(f"{url}/admin/models/load", json={"model": "tiny-llama-gptq", "quant": "awq"}, timeout=120)
    assert r.status_code == 400 and "gptq" in r.json()["error"]["message"], r.text


def test_swap_to_ngram_decoding_then_chat_speculates(server):
    """The decoding plugin and its options (defaults filled in) are shown in /v1/models; a reply that
    copies from its prompt is drafted and verified, and /metrics counts it."""
    url, _ = server
    r = httpx.post(f"{url}/admin/models/load", json={"model": "embedded", "kv_cache_gb": 0.25, "decoding": "ngram",
                                                     "decoding_options": {"k": 3, "min_n": 1}}, timeout=120)
    assert r.status_code == 200, r.text
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["decoding"] == "ngram"
    assert card["decoding_options"] == {"k": 3, "min_n": 1, "max_n": 4, "adaptive": True, "max_batch_size": 8}
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}],
        "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    assert "fox" in r.json()["choices"][0]["message"]["content"]
    metrics = {p[0]: float(p[1]) for p in map(str.split, httpx.get(f"{url}/metrics").text.splitlines())
               if len(p) == 2 and p[0].startswith("kvforge_spec_")}
    assert metrics["kvforge_spec_drafted_tokens"] > 0 and metrics["kvforge_spec_verify_steps"] > 0, metrics
    assert 0 < metrics["kvforge_spec_acceptance_rate"] <= 1 and metrics["kvforge_spec_mean_accepted_length"] >= 1


def test_draft_model_option_is_confined_to_the_models_directory(server, models_dir):
    """A draft model named over the API is looked up in the models directory, like the main model."""
    url, _ = server
    r = httpx.post(f"{url}/admin/models/load", timeout=120, json={
        "model": "tiny-llama", "decoding": "draft", "decoding_options": {"model": "tiny-llama", "k": 2}})
    assert r.status_code == 200, r.text
    card = r.json()["loaded"]
    assert card["decoding"] == "draft" and card["decoding_options"]["model"] == str(models_dir / "tiny-llama")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("decoding, options, param, fragment", [
    ("ngram", {"k": 0}, "decoding_options", "option 'k' of plugin 'ngram' must be >= 1"),
    ("ngram", {"lookahead": 2}, "decoding_options", "no option 'lookahead'"),
    ("ngram", {"min_n": 5}, "decoding_options", "'min_n'"),  # refused by the plugin as it is built
    ("no-such-plugin", {}, "decoding", "no-such-plugin"),
    ("none", {"k": 2}, "decoding_options", "without a decoding plugin"),
    ("draft", {"model": "../../etc"}, "decoding_options", "outside the models directory"),
    ("draft", {"model": "/etc"}, "decoding_options", "outside the models directory"),
])
def test_bad_decoding_choice_is_refused_and_the_old_model_keeps_serving(server, decoding, options, param, fragment):
    url, host = server
    before = httpx.get(f"{url}/v1/models").json()["data"][0]
    r = httpx.post(f"{url}/admin/models/load", timeout=120, json={
        "model": "tiny-llama", "decoding": decoding, "decoding_options": options})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["decoding"] == before["decoding"]
    assert host.name == before["id"]
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_models_show_tp_and_a_bad_tp_is_refused_and_the_old_model_keeps_serving(server):
    url, host = server
    before = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert before["tp"] == 1
    for tp in (0, -1, "two"):
        r = httpx.post(f"{url}/admin/models/load", timeout=120, json={"model": "tiny-llama", "tp": tp})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tp" and "tp" in error["message"], error
    assert host.name == before["id"]
    assert httpx.get(f"{url}/admin/models").json()["loaded"]["tp"] == 1
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_the_admin_request_takes_every_model_setting():
    """ModelSpec declares a model's load settings; the admin API's body takes each of them (the served name under
    --served-model-name's name) and gives them back as a spec: a setting added to one is not forgotten in the
    other."""
    from dataclasses import asdict, fields

    from kvforge.app.models.routes import LoadModelRequest

    api = set(LoadModelRequest.model_fields) - {"served_model_name"} | {"served_name"}
    assert api == {f.name for f in fields(ModelSpec)}
    body = LoadModelRequest(model="m.gguf", dtype="bfloat16", quant="gguf", quant_options={"kernel": "blocks"},
                            served_model_name="m", kv_cache_gb=0.5, kv_cache_dtype="int8", decoding="ngram",
                            decoding_options={"k": 2})
    assert asdict(body.spec(default_tp=2, default_pp=3, default_cpu_experts=True)) == {
        "model": "m.gguf", "dtype": "bfloat16", "quant": "gguf", "quant_options": {"kernel": "blocks"},
        "served_name": "m", "kv_cache_gb": 0.5, "kv_cache_dtype": "int8", "decoding": "ngram",
        "decoding_options": {"k": 2}, "tp": 2, "pp": 3, "cpu_experts": True}
    # the body's own over the server's
    assert LoadModelRequest(pp=1).spec(default_tp=2, default_pp=3).pp == 1
    assert LoadModelRequest(cpu_experts=False).spec(2, 3, default_cpu_experts=True).cpu_experts is False


def test_the_servers_cpu_experts_reaches_the_engine_through_the_spec():
    """--cpu-experts (settings file, environment) is a model setting: the server's spec carries it to the engine's
    config, and a load naming none keeps it (the host's default)."""
    from kvforge.app.models.factory import engine_config, spec_from_settings
    from kvforge.app.settings import ServeSettings

    for value in (True, False):
        settings = ServeSettings(cpu_experts=value)
        spec = spec_from_settings(settings)
        assert spec.cpu_experts is value and engine_config(spec, settings).cpu_experts is value


def test_a_quantized_kv_cache_holds_more_tokens_in_the_same_budget(server):
    """The card shows the KV cache type, its bytes per token and the tokens the pool holds: in the same --kv-cache-gb,
    int8 holds 128 / 66 of bf16's tokens (head_dim 64: 64 codes + a bf16 scale a row against 64 bf16 values), q4
    128 / 40; each serves."""
    url, _ = server
    cards = {}
    for kv_cache_dtype in ("auto", "int8", "q4"):
        r = httpx.post(f"{url}/admin/models/load", timeout=120, json={
            "model": "embedded", "dtype": "bfloat16", "kv_cache_gb": 0.0625, "kv_cache_dtype": kv_cache_dtype})
        assert r.status_code == 200, r.text
        cards[kv_cache_dtype] = card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["kv_cache_dtype"] == kv_cache_dtype == httpx.get(f"{url}/admin/models").json()["loaded"][
            "kv_cache_dtype"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3,
                                                      "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    memory = {k: card["memory"] for k, card in cards.items()}
    for kv_cache_dtype, row_bytes in (("auto", 128), ("int8", 66), ("q4", 40)):
        # K and V x 30 layers x 3 KV heads, one row each
        assert memory[kv_cache_dtype]["kv_bytes_per_token"] == 2 * 30 * 3 * row_bytes, memory
        assert memory[kv_cache_dtype]["kv_cache_bytes"] <= 0.0625 * (1 << 30)
    tokens = {k: m["kv_cache_tokens"] for k, m in memory.items()}
    block = 16  # the pool is whole blocks: the ratio of the budget's tokens, within a block of each
    assert abs(tokens["int8"] - tokens["auto"] * 128 / 66) <= 2 * block, tokens
    assert abs(tokens["q4"] - tokens["auto"] * 128 / 40) <= 4 * block, tokens


@pytest.mark.parametrize("body, fragment", [
    ({"model": "embedded", "kv_cache_dtype": "int4"}, "kv_cache_dtype"),  # not a KV cache type
    ({"model": "tiny-llama", "kv_cache_dtype": "q4"}, "head_dim 16"),  # q4's groups of 32 values: a 16-wide head
])
def test_a_bad_kv_cache_type_is_refused_naming_it_and_the_old_model_keeps_serving(server, body, fragment):
    url, host = server
    before = host.name
    r = httpx.post(f"{url}/admin/models/load", json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_cache_dtype" and fragment in error["message"], error
    assert host.name == before
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
