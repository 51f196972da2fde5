"""Fixtures of the API tests: one `kvforge serve` as README command 1 starts it, shared by the modules that test
its APIs with their official clients (openai and langchain, ollama, anthropic): one model load instead of three;
and one with a models directory of tiny checkpoints and a local Hub endpoint, shared by the models-on-demand and
pull tests. Package-scoped: they stop when the tests of this folder end (a later test may require that they
started no process, as the tensor-parallel tests do)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.local_hub import LocalHub
from tests.helpers.server_process import ServeProcess, readme_serve
from tests.helpers.tiny_models import save_tiny_embedding_model, save_tiny_model, tiny_configs

TINY_MODELS = ("tiny-a", "tiny-b", "tiny-c")  # in the models directory of `models_server`


@pytest.fixture(scope="package")
def readme_server(tmp_path_factory):
    process = readme_serve(tmp_path_factory.mktemp("data"), "--no-ui")
    yield process
    process.stop()


@pytest.fixture(scope="package")
def hub(tmp_path_factory, embedded_path):
    """A local Hub endpoint (tests/helpers/local_hub.py) with a tiny checkpoint (and a pickle file and a subfolder
    that a pull must leave) and a repository of two GGUF files."""
    repos = tmp_path_factory.mktemp("hub")
    save_tiny_model("llama3", repos / "tiny", embedded_path, seed=3)
    (repos / "tiny" / "pytorch_model.bin").write_bytes(b"a pickle checkpoint: never fetched")
    (repos / "tiny" / "onnx").mkdir()
    (repos / "tiny" / "onnx" / "model.json").write_text("{}")
    (repos / "gguf").mkdir()
    for quant in ("Q4_K_M", "Q8_0"):
        (repos / "gguf" / f"tiny-{quant}.gguf").write_bytes(b"GGUF" + quant.encode() * 64)
    served = LocalHub({"kvforge-tests/tiny-llama": repos / "tiny", "kvforge-tests/tiny-GGUF": repos / "gguf"})
    yield served
    served.close()


@pytest.fixture(scope="package")
def models_server(tmp_path_factory, embedded_path, hub):
    """`kvforge serve` on the embedded model with a models directory of three tiny random checkpoints (4096 tokens of
    context: long generations hold a model busy), a broken one and a sentence-transformers embedding checkpoint
    (tiny-embed, the --embedding-model), at most three models resident, the alias "fast" for tiny-c, and HF_ENDPOINT
    at the local Hub. `.models` is the directory."""
    models = tmp_path_factory.mktemp("models")
    config = tiny_configs()["qwen2"]
    config.max_position_embeddings = 4096
    for seed, name in enumerate(TINY_MODELS):
        save_tiny_model("qwen2", models / name, embedded_path, seed=seed, config=config, chat_template=True)
    (models / "broken").mkdir()
    (models / "broken" / "config.json").write_text('{"model_type": "llama"}')
    save_tiny_embedding_model(models / "tiny-embed", embedded_path, seed=5)
    process = ServeProcess("--no-ui", "--models-dir", str(models), "--data-dir", str(tmp_path_factory.mktemp("d")),
                           "--max-loaded-models", "3", "--kv-cache-gb", "0.1", "--keep-alive", "10m",
                           "--model-aliases", json.dumps({"fast": "tiny-c"}), "--embedding-model", "tiny-embed",
                           env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url})
    process.models = models
    yield process
    process.stop()
