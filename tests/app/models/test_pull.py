"""`kvforge pull` and Ollama's /api/pull: the real `huggingface_hub` client downloading into the models directory.
The Hub itself is out of reach from the test machines, so the downloads come from a local Hub endpoint
(tests/helpers/local_hub.py, through HF_ENDPOINT; tests/app/conftest.py `hub`) serving a tiny random checkpoint
and two GGUF files; offline is tested as it is (a closed port, the same error as no DNS)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import ollama
import pytest

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture(scope="module")
def server(models_server):  # tests/app/conftest.py: HF_ENDPOINT is the local Hub
    return models_server


def test_pull_streams_progress_then_the_checkpoint_is_listed_and_loads(server):
    client = ollama.Client(host=server.url, timeout=300)
    steps = list(client.pull("hf.co/kvforge-tests/tiny-llama", stream=True))
    statuses = [s.status for s in steps]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    weights = [s for s in steps if s.status == "pulling model.safetensors"]
    assert weights[-1].completed == weights[-1].total > 1000 and weights[-1].digest.startswith("sha256:")
    fetched = sorted(p.name for p in (server.models / "tiny-llama").iterdir())
    assert "model.safetensors" in fetched and "config.json" in fetched and "tokenizer.json" in fetched
    assert "pytorch_model.bin" not in fetched and "onnx" not in fetched  # no pickle, no subfolders
    assert not [p for p in server.models.iterdir() if p.name.startswith(".pull")]  # the staging folder is gone
    assert "tiny-llama:latest" in [m.model for m in client.list().models]
    # served by name at once (loaded on demand; unloaded again when idle: keep_alive 0)
    reply = client.generate(model="tiny-llama", prompt="Hi", raw=True, options={"num_predict": 3}, keep_alive=0)
    assert reply.eval_count == 3


def test_one_gguf_by_its_tag_and_the_refusals(server):
    client = ollama.Client(host=server.url, timeout=300)
    assert client.pull("kvforge-tests/tiny-GGUF:q8_0").status == "success"  # not streamed: one answer
    assert (server.models / "tiny-Q8_0.gguf").read_bytes().startswith(b"GGUFQ8_0")
    assert not (server.models / "tiny-Q4_K_M.gguf").exists()
    refusals = {"kvforge-tests/tiny-GGUF": "GGUF files only", "kvforge-tests/tiny-GGUF:Q2_K": "0 GGUF files match",
                "kvforge-tests/missing": "RepositoryNotFound", "kvforge-tests/tiny-llama": "already in the models",
                "not a hub id": "not a Hugging Face Hub model id",
                # ids of the right shape that the Hub's rules refuse (huggingface_hub raised them as a 500)
                "a/b.": "cannot start or end with '-' or '.'", "hf.co/owner/name-:Q4_K_M": "cannot start or end",
                "a--b/c": "Cannot have -- or ..", "owner/name.git": "cannot end by '.git'"}
    for name, reason in refusals.items():
        with pytest.raises(ollama.ResponseError) as refused:
            client.pull(name)
        assert refused.value.status_code == 400 and reason in refused.value.error, (name, refused.value.error)
        assert refused.value.error.startswith("model: "), refused.value.error  # names the field
    streamed = httpx.post(f"{server.url}/api/pull", json={"model": "a/b."}, timeout=60)  # refused before streaming
    assert streamed.status_code == 400 and streamed.json()["error"].startswith("model: "), streamed.text
    # streamed, a refusal found after the stream began is its last line
    lines = httpx.post(f"{server.url}/api/pull", json={"model": "kvforge-tests/tiny-GGUF"}, timeout=60).text
    assert lines.splitlines()[0] == '{"status": "pulling manifest"}' and "GGUF files only" in lines.splitlines()[-1]


def test_offline_is_one_clear_error_and_leaves_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvforge.app.cli", "pull", "HuggingFaceTB/SmolLM2-360M-Instruct",
                           "--models-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_ENDPOINT": CLOSED, "HF_HUB_OFFLINE": "0"})
    assert done.returncode == 2
    error = [line for line in done.stderr.splitlines() if line.startswith("kvforge: error:")]
    assert len(error) == 1 and "cannot reach the Hugging Face Hub" in error[0] and "offline" in error[0], done.stderr
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []


def test_a_server_without_a_models_directory_refuses(readme_server):
    response = httpx.post(f"{readme_server.url}/api/pull", json={"model": "kvforge-tests/tiny-llama"}, timeout=60)
    assert response.status_code == 400 and "models directory" in response.json()["error"]
