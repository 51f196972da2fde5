"""Embeddings through a real `kvforge serve` started as README command 1 starts it (the embedded model in its default
configuration), driven by the official `openai` and `ollama` clients: the two APIs give the same vectors, a batch
gives each input's own, paraphrases land closer than unrelated texts, and bad requests are refused by field."""

from __future__ import annotations

import httpx
import numpy as np
import ollama
import openai
import pytest

from tests.app.test_agent_api import MODEL
from tests.helpers.api_checks import assert_api_error

TEXTS = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Quarterly revenue grew by five percent.",
         "The company's sales rose 5% this quarter."]


@pytest.fixture(scope="module")
def server(readme_server):  # tests/app/conftest.py
    return readme_server


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)


@pytest.fixture(scope="module")
def atol(server) -> float:
    """How far the same text's vector may move between batches: fp32 rounding, or bf16's where the default dtype is
    bf16 (a CPU with AVX512_BF16 / AMX; seen there: ~1e-3 between a batch of 4 and one text alone)."""
    dtype = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["dtype"]
    return 1e-5 if dtype == "float32" else 5e-3


@pytest.fixture(scope="module")
def vectors(oai) -> np.ndarray:
    """TEXTS embedded in one batch, as the openai SDK asks by default (base64 floats, decoded by the SDK)."""
    result = oai.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in result.data] == [0, 1, 2, 3] and result.model == MODEL
    return np.array([d.embedding for d in result.data])


def test_openai_batch_is_each_inputs_own_unit_vector(oai, server, vectors, atol):
    assert vectors.shape[0] == 4 and vectors.shape[1] >= 64
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    alone = oai.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="float")
    assert np.allclose(alone.data[0].embedding, vectors[2], atol=atol)  # batched or alone, as floats or base64
    tokens = httpx.post(f"{server.url}/v1/tokenize", json={"prompt": TEXTS[2]}, timeout=60).json()["tokens"]
    assert alone.usage.prompt_tokens == alone.usage.total_tokens == len(tokens)
    from_ids = oai.embeddings.create(model=MODEL, input=[tokens], encoding_format="float")
    assert np.allclose(from_ids.data[0].embedding, vectors[2], atol=atol)
    similarity = vectors @ vectors.T
    assert min(similarity[0, 1], similarity[2, 3]) > max(similarity[0, 2], similarity[0, 3], similarity[1, 2],
                                                          similarity[1, 3]) + 0.05  # paraphrases closest


def test_ollama_embed_equals_openai_and_truncates_to_num_ctx(server, vectors, atol):
    client = ollama.Client(host=server.url, timeout=300)
    result = client.embed(model=MODEL, input=TEXTS)
    assert np.allclose(np.array(result.embeddings), vectors, atol=atol)
    assert result.prompt_eval_count > 20 and result.total_duration > 0
    assert np.allclose(client.embed(model=f"{MODEL}:latest", input=TEXTS[0]).embeddings[0], vectors[0], atol=atol)
    long_text = " ".join(TEXTS * 4)
    tokens = httpx.post(f"{server.url}/v1/tokenize", json={"prompt": long_text}, timeout=60).json()["tokens"]
    cut = client.embed(model=MODEL, input=long_text, options={"num_ctx": 16})  # truncate: Ollama's default
    first_16 = httpx.post(f"{server.url}/v1/embeddings", json={"input": tokens[:16]}, timeout=60).json()
    assert cut.prompt_eval_count == 16
    assert np.allclose(cut.embeddings[0], first_16["data"][0]["embedding"], atol=atol)
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=MODEL, input=long_text, truncate=False, options={"num_ctx": 16})
    assert refused.value.status_code == 400 and "options.num_ctx" in refused.value.error
    # Ollama's documented curl usage: a JSON body sent without a JSON content type
    response = httpx.post(f"{server.url}/api/embed", content=f'{{"model": "{MODEL}", "input": "x"}}',
                          headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert response.status_code == 200 and len(response.json()["embeddings"]) == 1


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": ["fine", ""]}, "input"),
    ("/v1/embeddings", {"input": [], "model": MODEL}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": [[10**7]]}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "pooling": "cls"}, "pooling"),
    ("/v1/embeddings", {"input": "word " * 9000}, "input"),
    ("/api/embed", {"model": MODEL, "input": "x", "options": {"temperature": 0.5}}, "options"),
    ("/api/embed", {"model": MODEL, "input": "x", "keep_alive": "soon"}, "keep_alive"),
    ("/api/embed", {"model": MODEL, "input": "word " * 9000, "truncate": False}, "input"),
])
def test_bad_requests_are_refused_naming_the_field(server, path, body, field):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert_api_error(response, path)
    assert field in response.text


def test_another_model_is_not_found_and_nothing_is_left_running(server):
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": "nomic-embed-text", "input": "x"}, timeout=60)
    assert response.status_code == 404 and "nomic-embed-text" in response.text
    response = httpx.post(f"{server.url}/api/embed", json={"model": "nomic-embed-text", "input": "x"}, timeout=60)
    assert response.status_code == 404 and "error" in response.json()
    metrics = httpx.get(f"{server.url}/metrics", timeout=60).text
    assert "kvforge_kv_blocks_used 0.0" in metrics
