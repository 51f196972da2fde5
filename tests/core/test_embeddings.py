"""Embedding requests through the engine (core/pooling.py): the mean of the last hidden states, L2-normalised, equal
to HF transformers' `last_hidden_state` pooled the same way, whatever shares the batch, however the prompt is
chunked, cached or preempted."""

from __future__ import annotations

import pytest
import torch

from kvforge.core import LLM, PoolingParams, SamplingParams

LONG = " ".join(f"Paragraph {i} describes the harbour, its boats and the weather that morning." for i in range(12))
TEXTS = ["The capital of France is Paris.", "x", "把下面的句子翻译成英文：今天天气很好。", LONG]


@pytest.fixture(scope="module")
def hf_embeddings(embedded_path, embedded_llm):
    """HF transformers' mean-pooled, normalised last hidden state of each of TEXTS (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_path, dtype=torch.float32).eval().model
    rows = []
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([embedded_llm.tokenizer.encode(text)])
            rows.append(torch.nn.functional.normalize(model(ids).last_hidden_state[0].mean(0), dim=-1))
    return torch.stack(rows)


def _close(ours: list[list[float]], theirs: torch.Tensor) -> None:
    ours = torch.tensor(ours)
    assert ours.shape == theirs.shape
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(ours)), atol=1e-5)
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()


def test_embeddings_equal_hf_in_one_batch_beside_generation(embedded_llm, hf_embeddings):
    engine = embedded_llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = embedded_llm.generate(TEXTS[0], greedy)[0].token_ids  # also caches the first text's blocks
    ids = [engine.add_request(text, PoolingParams()) for text in TEXTS]
    generating = engine.add_request(TEXTS[0], greedy)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    _close([finals[i].embedding for i in ids], hf_embeddings)
    assert finals[generating].token_ids == alone
    assert all(finals[i].token_ids == [] and finals[i].finish_reason == "stop" for i in ids)
    assert finals[ids[0]].num_cached_tokens == 0  # never started from the cache: every position is pooled
    assert engine.block_pool.num_used == 0


def test_chunked_and_preempted_embeddings_are_unchanged(embedded_path, hf_embeddings):
    """A KV pool too small for everything at once: a generation from a long prompt arrives first and grows, the
    embedding requests after it (one of the same prompt: it must not start from the generation's cached blocks)
    are prefilled in chunks of up to 32 tokens, preempted (latest arrival first) and recomputed; each embedding
    still equals HF's."""
    small = LLM(str(embedded_path), progress=False, dtype="float32", num_kv_blocks=14, block_size=16,
                max_num_batched_tokens=32)
    engine = small.engine
    try:
        engine.add_request(LONG, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        ids = [engine.add_request(text, PoolingParams()) for text in (LONG, TEXTS[0])]
        finals = {}
        while engine.has_unfinished():
            finals |= {out.request_id: out for out in engine.step() if out.finished}
        assert engine.stats().preemptions_total > 0
        _close([finals[i].embedding for i in ids], hf_embeddings[[3, 0]])
        assert engine.block_pool.num_used == 0
    finally:
        engine.close()


def test_an_aborted_embedding_request_frees_its_blocks_and_has_no_embedding(embedded_llm, monkeypatch):
    engine = embedded_llm.engine
    monkeypatch.setattr(engine.scheduler, "max_num_batched_tokens", 16)  # aborted between two chunks
    request_id = engine.add_request(LONG, PoolingParams())
    engine.step()
    assert engine.block_pool.num_used > 0
    (out,) = engine.abort(request_id)
    assert out.finished and out.finish_reason == "abort" and out.embedding is None
    assert engine.block_pool.num_used == 0 and not engine.has_unfinished()


def test_unnormalised_embedding_is_the_plain_mean_and_no_input_is_kept(embedded_llm):
    cached = embedded_llm.engine.block_pool.num_cached_free
    (plain,) = embedded_llm.embed(TEXTS[0], normalize=False)
    assert embedded_llm.embed(LONG + " Unseen.") and embedded_llm.engine.block_pool.num_cached_free == cached
    (unit,) = embedded_llm.embed(TEXTS[0])
    plain = torch.tensor(plain)
    assert plain.norm() > 1.5  # the final norm's scale, not a unit vector
    assert torch.allclose(plain / plain.norm(), torch.tensor(unit), atol=1e-6)


def test_a_prompt_longer_than_the_context_is_refused_before_it_runs(embedded_llm):
    from kvforge.core import RequestRejected

    too_long = [1] * (embedded_llm.engine.max_model_len + 1)
    with pytest.raises(RequestRejected, match="maximum context length"):
        embedded_llm.embed([too_long])
    assert not embedded_llm.engine.has_unfinished()


def test_a_sentence_transformers_checkpoint_pools_as_its_config_says(tmp_path, embedded_path):
    """A bare Qwen3 model (no head, as Qwen3-Embedding ships) with last-token pooling and a Normalize module: the
    embedding is its last token's hidden state, normalised, as HF transformers computes it; a pooling this engine
    does not do is refused when the model loads."""
    from tests.helpers.tiny_models import save_tiny_embedding_model

    hf = save_tiny_embedding_model(tmp_path / "embed", embedded_path, seed=5)
    llm = LLM(str(tmp_path / "embed"), progress=False, dtype="float32", kv_cache_bytes=16 << 20)
    try:
        assert llm.engine.pooling.mode == "last" and llm.engine.pooling.normalize
        ours = llm.embed(TEXTS)
        with torch.no_grad():
            theirs = torch.stack([torch.nn.functional.normalize(hf(torch.tensor([llm.engine.tokenizer.encode(t)]))
                                                                .last_hidden_state[0, -1], dim=-1) for t in TEXTS])
        _close(ours, theirs)
    finally:
        llm.engine.close()
    save_tiny_embedding_model(tmp_path / "max", embedded_path, seed=5, pooling="pooling_mode_max_tokens")
    with pytest.raises(ValueError, match="pooling pooling_mode_max_tokens is not supported"):
        LLM(str(tmp_path / "max"), progress=False, dtype="float32", kv_cache_bytes=16 << 20)


def test_a_scoring_request_gives_the_last_positions_logits_and_may_start_from_the_cache(embedded_llm):
    """PoolingParams(score_token_ids=...): the logits of those tokens after the prompt (a reranker's yes / no), the
    row teacher forcing reads there; only the last position is needed, so a repeat starts from the prefix cache and
    scores alike."""
    engine = embedded_llm.engine
    prompt = embedded_llm.tokenizer.encode(LONG)
    tokens = (embedded_llm.tokenizer.encode("yes", add_special_tokens=False)[0], 42, 7)
    first = {"scores": None, "cached": None}
    for attempt in range(2):
        request_id = engine.add_request(prompt, PoolingParams(score_token_ids=tokens))
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == request_id and out.finished:
                    scores, cached = out.embedding, out.num_cached_tokens
        if attempt == 0:
            first = {"scores": scores, "cached": cached}
    assert first["cached"] == 0 and cached >= len(prompt) - engine.config.block_size
    # the repeat attends its last tokens to the cached prefix through another path than the fresh prompt's chunks:
    # fp32 rounding apart (1.07e-5 measured in a full-suite run whose kernels were timed on a busy machine)
    assert scores == pytest.approx(first["scores"], abs=1e-4) and len(scores) == 3
    # logit differences are logprob differences: the same row as teacher forcing reads after the prompt
    yes, other = (engine.prompt_logprobs(prompt + [t])[-1].item() for t in tokens[:2])
    assert scores[0] - scores[1] == pytest.approx(yes - other, abs=1e-4)
    assert engine.block_pool.num_used == 0
