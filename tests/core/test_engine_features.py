"""Engine features on the embedded model: stop strings across token boundaries, n samples sharing the
prompt's blocks, logprobs against HF transformers, min_tokens, prefix caching, abort, metrics.
Every test leaves the shared engine with no KV blocks in use."""

from __future__ import annotations

import pytest
import torch

from kvforge.core import LLM, SamplingParams
from tests.helpers.engine_helpers import assert_idle, drain

COUNT = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
STORY = "Once upon a time"
LOGPROB_TOLERANCE = 1e-4


# --- stop strings --------------------------------------------------------------------------------

def _spanning_stop_string(tok, token_ids: list[int], text: str, length: int = 4) -> tuple[str, int]:
    """A substring of `text`, first occurring at its position, that covers 2+ tokens' text."""
    ends = [len(tok.decode(token_ids[:i])) for i in range(len(token_ids) + 1)]  # text offset after i tokens
    assert ends[-1] == len(text)
    for start in range(len(text) // 3, len(text) - length):
        stop = text[start:start + length]
        if text.find(stop) != start or not stop.strip():
            continue
        boundaries = [b for b in ends if start < b < start + length]
        if boundaries:
            return stop, start
    raise AssertionError(f"no stop string spanning tokens in {text!r}")


def test_stop_string_across_token_boundaries(embedded_llm):
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    prompt = tok.apply_chat_template(COUNT)
    original = embedded_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30))[0]
    stop, cut = _spanning_stop_string(tok, original.token_ids, original.text)
    # which tokens the stop string's characters come from: at least two distinct ones
    ends = [len(tok.decode(original.token_ids[:i])) for i in range(len(original.token_ids) + 1)]
    covering = {i for i in range(len(original.token_ids)) for c in range(cut, cut + len(stop))
                if ends[i] <= c < ends[i + 1]}
    assert len(covering) >= 2, (stop, covering)
    completing = next(i for i, e in enumerate(ends) if e >= cut + len(stop))  # tokens needed to see it

    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, stop=["\u2603", stop]))
    outs = drain(engine)[request_id]
    final = outs[-1]
    assert final.finished and final.finish_reason == "stop" and final.stop_reason == stop  # the one that matched
    assert final.text == original.text[:cut]
    assert final.token_ids == original.token_ids[:completing]
    streamed = ""
    for out in outs:
        streamed += out.delta_text
        assert original.text[:cut].startswith(streamed), (stop, out.delta_text, streamed)
        assert stop not in out.delta_text
        assert out.text == streamed
    assert streamed == original.text[:cut]

    # the offline API agrees
    again = embedded_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=stop))[0]
    assert again.finish_reason == "stop" and again.text == original.text[:cut]
    assert_idle(embedded_llm)


# --- n samples -----------------------------------------------------------------------------------

def test_n_samples_share_the_prompt_and_sample_zero_is_the_n1_stream(embedded_llm):
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}])
    assert len(prompt) > 2 * engine.config.block_size
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8)
    request_id = engine.add_request(prompt, params)
    samples = engine._requests[request_id]
    shared_seen = False
    finals = {}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                finals[out.index] = out
        live = [s for s in samples if not s.is_finished and s.block_table]
        if len(live) == 4:
            first_blocks = {s.block_table[0] for s in live}
            assert len(first_blocks) == 1  # the prompt's first block is shared, not copied
            assert engine.block_pool.ref_counts[first_blocks.pop()] == 4
            shared_seen = True
    assert shared_seen
    assert sorted(finals) == [0, 1, 2, 3]
    assert_idle(embedded_llm)

    outs = embedded_llm.generate(prompt, params)[0]
    assert isinstance(outs, list) and len(outs) == 4
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert [o.token_ids for o in outs] == [finals[i].token_ids for i in range(4)]  # seeded: reproducible
    single = embedded_llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=8))[0]
    assert outs[0].token_ids == single.token_ids
    assert outs[0].text == single.text
    assert_idle(embedded_llm)


def test_n_greedy_samples_all_equal_the_greedy_output(embedded_llm):
    greedy = embedded_llm.generate(STORY, SamplingParams(temperature=0, max_tokens=8))[0]
    outs = embedded_llm.generate(STORY, SamplingParams(n=3, temperature=0, max_tokens=8))[0]
    assert [o.index for o in outs] == [0, 1, 2]
    for out in outs:
        assert out.token_ids == greedy.token_ids
        assert out.text == greedy.text
    assert_idle(embedded_llm)


@pytest.mark.parametrize("ending", ["max_tokens", "stop"])
def test_n_samples_when_sample_zero_finishes_on_its_first_token(embedded_llm, ending):
    """The other samples fork from sample 0 at the prompt's end, in the step where sample 0 gets its first
    token: that token may finish it (freeing its blocks) before they took their share (a 500 found by
    fuzzing the server with n=2, max_tokens=1)."""
    prompt = embedded_llm.tokenizer.encode("My favourite animal is the")
    assert len(prompt) % embedded_llm.engine.config.block_size  # the prompt ends in a partial block
    if ending == "max_tokens":
        params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=1)
    else:  # sample 0 is the seed's n=1 stream: a stop string ends it at its first token, the others go on
        free = embedded_llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6))[0]
        first = embedded_llm.tokenizer.decode(free[0].token_ids[:1])
        assert first.strip() and not any(first in o.text for o in free[1:]), [o.text for o in free]
        params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, stop=[first])
    outs = embedded_llm.generate(prompt, params)[0]
    assert [o.index for o in outs] == [0, 1, 2]
    if ending == "max_tokens":
        assert all(len(o.token_ids) == 1 and o.finish_reason == "length" for o in outs)
    else:
        assert outs[0].finish_reason == "stop" and outs[0].text == ""
        assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in free[1:]]  # as if sample 0 went on
    assert_idle(embedded_llm)


# --- logprobs ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_model(embedded_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_path, dtype=torch.float32).eval()


def test_logprobs_match_hf(embedded_llm, hf_model):
    tok = embedded_llm.tokenizer
    prompts = [tok.apply_chat_template(FRANCE), tok.encode(STORY)]
    outs = embedded_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=5))
    for prompt, out in zip(prompts, outs):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.inference_mode():
            logits = hf_model(input_ids=ids).logits[0].float()
        reference = torch.log_softmax(logits[len(prompt) - 1:], dim=-1)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            ref = reference[j]
            assert entry.token_id == token
            assert abs(entry.logprob - float(ref[token])) <= LOGPROB_TOLERANCE, (j, entry.logprob, float(ref[token]))
            assert len(entry.top) == 5
            values = [v for _, v in entry.top]
            assert values == sorted(values, reverse=True)
            ref_top = ref.topk(5).values
            for (top_id, value), ref_value in zip(entry.top, ref_top):
                assert abs(value - float(ref[top_id])) <= LOGPROB_TOLERANCE  # each entry is that token's logprob
                assert abs(value - float(ref_value)) <= LOGPROB_TOLERANCE  # and they are the 5 largest
            assert token == entry.top[0][0] or abs(entry.top[0][1] - entry.logprob) <= LOGPROB_TOLERANCE
    assert_idle(embedded_llm)


# --- min_tokens ----------------------------------------------------------------------------------

def test_min_tokens_keeps_going_past_eos(embedded_llm):
    eos_ids = embedded_llm.tokenizer.eos_token_ids
    short = embedded_llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    assert short.token_ids[-1] in eos_ids
    out = embedded_llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24, min_tokens=20))[0]
    assert len(out.token_ids) >= 20
    assert not any(t in eos_ids for t in out.token_ids[:20])  # masked while fewer than 20 tokens existed
    assert out.token_ids[: len(short.token_ids) - 1] == short.token_ids[:-1]  # same until the EOS
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in eos_ids
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 24
    assert_idle(embedded_llm)


# --- penalties -----------------------------------------------------------------------------------

def _penalised(logits: torch.Tensor, prompt: list[int], output: list[int], repetition_penalty: float = 1.0,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> torch.Tensor:
    """The penalties by their definitions (repetition: HF / CTRL on prompt + output; presence and
    frequency: OpenAI, on the output)."""
    logits = logits.clone()
    for token in set(prompt) | set(output):
        value = logits[token]
        logits[token] = value / repetition_penalty if value > 0 else value * repetition_penalty
    for token in set(output):
        logits[token] -= output.count(token) * frequency_penalty + presence_penalty
    return logits


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.5}, {"presence_penalty": 1.5},
                                     {"frequency_penalty": 1.0}])
def test_penalties_follow_their_definition_on_the_model(embedded_llm, hf_model, penalty):
    """Greedy, this prompt continues " 2022-01-01": each penalty changes that, and every pick under a
    penalty is the argmax of HF's logits penalised by the definition."""
    tok = embedded_llm.tokenizer
    prompt = tok.encode("The weather today is")
    plain = embedded_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10))[0]
    out = embedded_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, **penalty))[0]
    assert out.token_ids != plain.token_ids
    with torch.inference_mode():
        logits = hf_model(input_ids=torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
    for j, token in enumerate(out.token_ids):
        expected = _penalised(logits[j], prompt, out.token_ids[:j], **penalty)
        top2 = expected.topk(2)
        if int(top2.indices[0]) != token:
            gap = float(top2.values[0] - top2.values[1])
            assert gap < 1e-3, (j, token, top2.indices.tolist(), gap)
            break  # a near tie: past it the two runs may differ
    assert_idle(embedded_llm)


# --- prefix caching ------------------------------------------------------------------------------

SYSTEM = ("You are Quillon, a meticulous assistant for the Harbour Street community library. You answer "
          "questions about opening hours, membership, book reservations, the reading room, the children's "
          "corner and the Tuesday evening chess club. You are polite, brief and precise, and when you do not "
          "know something you say so and suggest asking the front desk.")


@pytest.fixture(scope="module")
def uncached_llm(embedded_path):
    # fp32, as embedded_llm: its tokens are compared with that engine's (dtype auto is bf16 on a CPU with AMX)
    return LLM(str(embedded_path), progress=False, kv_cache_bytes=64 << 20, enable_prefix_caching=False,
               dtype="float32")


def test_prefix_cache_reuses_a_shared_system_prompt(embedded_llm, uncached_llm):
    engine, tok = embedded_llm.engine, embedded_llm.tokenizer
    block = engine.config.block_size
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
                     for question in ("When does the library open on Sundays?", "How do I reserve a book?")]
    prompts = [tok.apply_chat_template(c) for c in conversations]
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert common > 3 * block
    params = SamplingParams(temperature=0, max_tokens=10)
    before = engine.stats()

    first = embedded_llm.generate(prompts[0], params)[0]
    assert first.num_cached_tokens == 0  # this system prompt is new to the engine
    second = embedded_llm.generate(prompts[1], params)[0]
    assert second.num_cached_tokens > 0 and second.num_cached_tokens % block == 0
    assert second.num_cached_tokens == common // block * block  # every full block of the shared prefix
    assert second.metrics["cached_tokens"] == second.num_cached_tokens

    after = engine.stats()
    assert after.kv_blocks_cached > 0
    assert after.kv_blocks_used == 0
    assert after.prefix_cache_hit_rate > 0
    assert after.cached_tokens_total - before.cached_tokens_total == second.num_cached_tokens
    assert after.prompt_tokens_total - before.prompt_tokens_total == len(prompts[0]) + len(prompts[1])
    assert_idle(embedded_llm)

    references = [uncached_llm.generate(p, params)[0] for p in prompts]
    assert [r.num_cached_tokens for r in references] == [0, 0]
    assert references[1].token_ids == second.token_ids
    assert references[0].token_ids == first.token_ids
    stats = uncached_llm.engine.stats()
    assert stats.kv_blocks_cached == 0 and stats.cached_tokens_total == 0
    assert uncached_llm.engine.block_pool.num_used == 0
    assert_idle(embedded_llm)


# --- abort ---------------------------------------------------------------------------------------

def test_abort_emits_final_outputs(embedded_llm):
    engine = embedded_llm.engine
    running = engine.add_request(STORY, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=30,
                                                       ignore_eos=True))
    for _ in range(3):
        engine.step()
    finals = engine.abort(running)
    assert sorted(o.index for o in finals) == [0, 1]
    for out in finals:
        assert out.request_id == running
        assert out.finished and out.finish_reason == "abort"
        assert len(out.token_ids) == 3
        assert out.metrics is not None and out.metrics["generated_tokens"] == 3
    assert_idle(embedded_llm)

    waiting = engine.add_request(STORY, SamplingParams(max_tokens=4))
    finals = engine.abort(waiting)
    assert len(finals) == 1
    assert finals[0].finished and finals[0].finish_reason == "abort" and finals[0].token_ids == []
    assert engine.abort(waiting) == []  # nothing left to abort

    # n samples not yet forked off sample 0 end too, each with its own final output
    unforked = engine.add_request(STORY, SamplingParams(n=3, temperature=1.0, max_tokens=4))
    finals = engine.abort(unforked)
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert all(o.finished and o.finish_reason == "abort" for o in finals)
    assert engine.step() == []
    assert_idle(embedded_llm)


# --- metrics -------------------------------------------------------------------------------------

def test_finished_output_metrics(embedded_llm):
    tok = embedded_llm.tokenizer
    prompt = tok.encode("The three primary colours are")
    out = embedded_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    m = out.metrics
    assert m["prompt_tokens"] == len(prompt) == len(out.prompt_token_ids)
    assert m["generated_tokens"] == len(out.token_ids) == 6
    assert m["cached_tokens"] == out.num_cached_tokens
    for key in ("queue_time", "ttft", "tpot", "e2e_latency"):
        assert isinstance(m[key], float) and m[key] >= 0, (key, m[key])
    assert m["tpot"] > 0
    assert m["queue_time"] <= m["ttft"] <= m["e2e_latency"]
    assert m["ttft"] + 5 * m["tpot"] == pytest.approx(m["e2e_latency"], rel=1e-6, abs=1e-9)
    assert m["e2e_latency"] < 60

    one = embedded_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0]
    assert one.metrics["generated_tokens"] == 1 and one.metrics["tpot"] is None
    assert one.metrics["ttft"] >= 0
    assert_idle(embedded_llm)
