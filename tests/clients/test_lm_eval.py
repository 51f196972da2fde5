"""lm-eval (EleutherAI's evaluation harness) against the server, offline: tasks are YAML files in a temporary folder
over local JSON files (`dataset_path: json`, `dataset_kwargs.data_files`), found through a TaskManager that indexes
only that folder.

`local-completions` scores loglikelihood requests by sending each context + continuation as token ids to
/v1/completions (a batch of token-id lists as `prompt`, `echo: true`, `logprobs: 1`, `max_tokens: 1`) and summing
`choices[i].logprobs.token_logprobs[ctxlen:-1]`; `is_greedy` compares each with `max(top_logprobs[k].values())`.
Its tokenizer is the server's own when /tokenizer_info and /tokenize answer (tokenizer_backend auto -> remote),
else a local Hugging Face tokenizer (tokenizer_backend huggingface, tokenizer=<local dir>: no Hub needed)."""

from __future__ import annotations

import json

import pytest

from tests.clients import MODEL
from tests.clients.conftest import client_module

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("Which planet is known as the red planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
    ("What color is the sky on a clear day?", ["green", "red", "yellow", "blue"], 3),
]
TEXTS = ["The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and the children played.",
         "Water boils at one hundred degrees Celsius at sea level."]
PROMPTS = ["Q: What is two plus two?\nA:", "Q: Name a fruit that is yellow.\nA:"]


def task_yaml(name: str, data: str, cache: str, **fields) -> str:
    config = {"task": name, "dataset_path": "json",
              "dataset_kwargs": {"data_files": {"test": data}, "cache_dir": cache}, "test_split": "test", **fields}
    return json.dumps(config, indent=1)  # JSON is YAML


@pytest.fixture(scope="module")
def lm_eval():
    return client_module("lm_eval", "lm-eval")


@pytest.fixture(scope="module")
def tasks(lm_eval, tmp_path_factory):
    """Three tasks over local JSON files: multiple choice (loglikelihood), a text's perplexity
    (loglikelihood_rolling) and short answers (generate_until, stopped at a newline)."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    cache = str(folder / "datasets")
    rows = {"mc": [{"question": q, "choices": c, "label": label} for q, c, label in QUESTIONS],
            "ppl": [{"text": t} for t in TEXTS], "gen": [{"prompt": p, "answer": "x"} for p in PROMPTS]}
    for name, docs in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    mean = {"aggregation": "mean", "higher_is_better": True}
    (folder / "mc.yaml").write_text(task_yaml(
        "kvforge_mc", str(folder / "mc.jsonl"), cache, output_type="multiple_choice",
        doc_to_text="Question: {{question}}\nAnswer:", doc_to_choice="{{choices}}", doc_to_target="label",
        metric_list=[{"metric": "acc", **mean}, {"metric": "acc_norm", **mean}]))
    (folder / "ppl.yaml").write_text(task_yaml(
        "kvforge_ppl", str(folder / "ppl.jsonl"), cache, output_type="loglikelihood_rolling", doc_to_text="",
        doc_to_target="{{text}}", metric_list=[{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]))
    (folder / "gen.yaml").write_text(task_yaml(
        "kvforge_gen", str(folder / "gen.jsonl"), cache, output_type="generate_until", doc_to_text="{{prompt}}",
        doc_to_target="{{answer}}", generation_kwargs={"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
        metric_list=[{"metric": "exact_match", **mean}]))
    return TaskManager(include_path=str(folder), include_defaults=False)


def evaluate(lm_eval, lm, tasks, names, **kwargs) -> dict:
    results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=tasks, log_samples=True,
                                      bootstrap_iters=0, **kwargs)
    assert results is not None
    return results


def responses(results: dict, task: str) -> list:
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_loglikelihoods_through_the_server_equal_lm_evals_hf_model(lm_eval, tasks, fp32_server, embedded_path):
    """lm-eval's `local-completions` finds the server's tokenizer by itself (/tokenizer_info + /tokenize: the remote
    backend, no Hub) and gets every multiple-choice loglikelihood and every rolling-window (perplexity) loglikelihood
    of lm-eval's own `hf` model on the same fp32 checkpoint within 1e-4, with the same is_greedy flags and so the same
    accuracy -- sending batches of 4 token-id prompts, single prompts from 2 concurrent requests (its aiohttp path),
    or batches of prompt strings (tokenized_requests=False: the ids detokenized, the server tokenizing them again)."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    def remote(**fields):
        return LocalCompletionsAPI(base_url=f"{fp32_server.url}/v1/completions", model=MODEL, max_retries=1,
                                   **fields)

    auto = remote(batch_size=4)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(embedded_path))
    assert auto.tokenizer_backend == "remote"
    assert auto.eot_token_id == hf_tokenizer.eos_token_id
    assert auto.prefix_token_id == (hf_tokenizer.bos_token_id or hf_tokenizer.eos_token_id)
    assert auto.tok_encode("Hello world") == hf_tokenizer("Hello world", add_special_tokens=False).input_ids
    names = ["kvforge_mc", "kvforge_ppl"]
    reference = evaluate(lm_eval, HFLM(pretrained=str(embedded_path), dtype="float32", device="cpu", batch_size=1),
                         tasks, names)
    for lm in (auto, remote(num_concurrent=2), remote(batch_size=4, tokenized_requests=False)):
        served = evaluate(lm_eval, lm, tasks, names)
        for task in names:
            got, want = responses(served, task), responses(reference, task)
            assert len(got) == len(want) == {"kvforge_mc": len(QUESTIONS), "kvforge_ppl": len(TEXTS)}[task]
            for got_doc, want_doc in zip(got, want, strict=True):
                if task == "kvforge_mc":  # one (loglikelihood, is_greedy) per choice
                    assert [g for _, g in got_doc] == [g for _, g in want_doc]
                    got_doc, want_doc = [ll for ll, _ in got_doc], [ll for ll, _ in want_doc]
                assert got_doc == pytest.approx(want_doc, abs=1e-4)
        assert served["results"]["kvforge_mc"]["acc,none"] == reference["results"]["kvforge_mc"]["acc,none"]
        assert served["results"]["kvforge_ppl"]["word_perplexity,none"] == pytest.approx(
            reference["results"]["kvforge_ppl"]["word_perplexity,none"], rel=1e-3)


def test_generate_until_offline_with_a_local_tokenizer(lm_eval, tasks, server, embedded_path):
    """Offline without the server's tokenizer API: the tokenizer from the local checkpoint folder (no Hub). Greedy
    generations come back for each prompt as token ids, cut at the task's stop sequence, within max_gen_toks."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    local = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=MODEL,
                                tokenizer_backend="huggingface", tokenizer=str(embedded_path), max_retries=1)
    assert local.tokenizer_backend == "huggingface"
    results = evaluate(lm_eval, local, tasks, ["kvforge_gen"])
    texts = [r[0] for r in responses(results, "kvforge_gen")]
    assert len(texts) == len(PROMPTS)
    for text in texts:
        assert isinstance(text, str) and "\n" not in text
        assert len(local.tok_encode(text)) <= 12
    assert "exact_match,none" in results["results"]["kvforge_gen"]


def test_chat_completions_with_the_chat_template(lm_eval, tasks, server):
    """`local-chat-completions` with apply_chat_template: each prompt goes as chat messages to /v1/chat/completions
    (no tokenizer on the client); the reply's text is the response, cut at the stop sequence."""
    from lm_eval.models.openai_completions import LocalChatCompletion

    chat = LocalChatCompletion(base_url=f"{server.url}/v1/chat/completions", model=MODEL, max_retries=1)
    results = evaluate(lm_eval, chat, tasks, ["kvforge_gen"], apply_chat_template=True)
    texts = [r[0] for r in responses(results, "kvforge_gen")]
    assert len(texts) == len(PROMPTS) and all(isinstance(t, str) and "\n" not in t for t in texts)
