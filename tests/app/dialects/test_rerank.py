"""POST /v1/rerank (and llama.cpp's /rerank, Cohere's /v2/rerank) through a real `kvforge serve` of a reranker: a tiny
random Qwen3 checkpoint named as Qwen3-Reranker's are, served in fp32 (a chat model in the models directory beside it,
loaded on demand). Each document's
relevance is the model's probability of "yes" against "no" after the reranker's prompt, equal to HF transformers'
(fp32) for the same prompt; the documents come back most relevant first, cut to top_n; a model that is no reranker,
an unknown field or model, and a document too long get the errors they should."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from kvforge.app.generate.rerank import DEFAULT_INSTRUCTION, reranker_prompt
from tests.helpers.server_process import readme_serve
from tests.helpers.tiny_models import save_tiny_model, tiny_configs

RERANKER = "tiny-Qwen3-Reranker"
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "The Nile is a river in Africa.",
             "Bananas are rich in potassium.", "France's capital city, Paris, lies on the Seine."]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, embedded_path):
    """The models directory (a tiny reranker and a tiny chat model) and the reranker's HF twin (fp32)."""
    models = tmp_path_factory.mktemp("models")
    model = save_tiny_model("qwen3", models / RERANKER, embedded_path, seed=7, config=tiny_configs()["qwen3"])
    save_tiny_model("qwen2", models / "tiny-chat", embedded_path, seed=1)
    cross_encoder = models / "bge-reranker-base"  # an XLM-R sequence classifier: an architecture kvforge does not run
    cross_encoder.mkdir()
    (cross_encoder / "config.json").write_text(json.dumps({
        "model_type": "xlm-roberta", "architectures": ["XLMRobertaForSequenceClassification"], "num_labels": 1}))
    from safetensors.torch import save_file

    save_file({"classifier.out_proj.weight": torch.zeros(1, 8)}, cross_encoder / "model.safetensors")
    return models, model


@pytest.fixture(scope="module")
def server(tmp_path_factory, reranker):
    models = reranker[0]
    process = readme_serve(tmp_path_factory.mktemp("data"), "--no-ui", "--model", str(models / RERANKER),
                           "--served-model-name", RERANKER, "--models-dir", str(models), "--dtype", "float32")
    yield process
    process.stop()


def hf_scores(model, tokenizer, instruction: str) -> list[float]:
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    scores = []
    for document in DOCUMENTS:
        ids = tokenizer(reranker_prompt(instruction, QUERY, document), add_special_tokens=False).input_ids
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1].float()
        scores.append(torch.softmax(last[[no, yes]], -1)[1].item())
    return scores


def test_scores_equal_hf_and_come_most_relevant_first(server, reranker):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reranker[0] / RERANKER)
    for path, instruction in (("/v1/rerank", None), ("/rerank", "Find the passage that answers the question")):
        body = {"model": RERANKER, "query": QUERY, "documents": [DOCUMENTS[0], *({"text": d} for d in DOCUMENTS[1:])]}
        if instruction:
            body["instruction"] = instruction
        reply = httpx.post(f"{server.url}{path}", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        ranked = reply.json()
        assert ranked["model"] == RERANKER and ranked["usage"]["total_tokens"] > 4 * 40
        expected = hf_scores(reranker[1], tokenizer, instruction or DEFAULT_INSTRUCTION)
        by_index = {r["index"]: r for r in ranked["results"]}
        assert sorted(by_index) == [0, 1, 2, 3]
        assert [by_index[i]["relevance_score"] for i in range(4)] == pytest.approx(expected, abs=1e-4)
        scores = [r["relevance_score"] for r in ranked["results"]]
        assert scores == sorted(scores, reverse=True)  # most relevant first
        assert all(by_index[i]["document"] == {"text": DOCUMENTS[i]} for i in range(4))
        if instruction is None:
            default_order = [r["index"] for r in ranked["results"]]
    cut = httpx.post(f"{server.url}/v2/rerank", timeout=300, json={
        "model": RERANKER, "query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in cut["results"]] == default_order[:2]
    assert all("document" not in r for r in cut["results"])


@pytest.mark.parametrize("body, status, param", [
    ({"model": "tiny-chat"}, 400, "model"),  # loads, but is no reranker
    ({"model": "bge-reranker-base"}, 400, "model"),  # a cross-encoder: refused as it loads, naming its architecture
    ({"model": "nowhere"}, 404, "model"),
    ({"rank_fields": ["text"]}, 400, "rank_fields"),  # Cohere's: documents have no fields here
    ({"documents": []}, 400, "documents"),
    ({"documents": ["word " * 600]}, 400, "documents"),  # past the tiny model's 512 tokens
    ({"query": ""}, 400, "query"),
])
def test_bad_requests_name_the_field(server, body, status, param):
    reply = httpx.post(f"{server.url}/v1/rerank", timeout=300,
                       json={"model": RERANKER, "query": QUERY, "documents": DOCUMENTS} | body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    if body.get("model") == "bge-reranker-base":
        assert "XLMRobertaForSequenceClassification" in reply.json()["error"]["message"], reply.json()
