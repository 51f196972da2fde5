"""LLMEngine / LLM on the embedded model: sampling params, seeding, stop conditions, admission
control, abort and streaming. Every test leaves the shared engine with no KV blocks in use."""

from __future__ import annotations

import pytest

from kvforge.core import LLM, RequestRejected, SamplingParams
from tests.helpers.engine_helpers import assert_idle, drain

STORY = "Once upon a time"
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]


# --- SamplingParams ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"seed": "x"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids"),
])
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_valid_values():
    params = SamplingParams(temperature=0, max_tokens=1, seed=0, stop_token_ids=[0, 5])
    assert params.greedy
    assert not SamplingParams(temperature=0.7).greedy


# --- seeding ----------------------------------------------------------------------------------

def test_seed_gives_same_tokens_alone_and_in_a_batch(embedded_llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=6, seed=1234)
    alone = embedded_llm.generate(STORY, seeded)[0]
    assert len(alone.token_ids) == 6
    batch = embedded_llm.generate(
        ["The weather today is", STORY, "def main():"],
        [SamplingParams(temperature=0.8, max_tokens=6, seed=7), seeded, SamplingParams(temperature=0, max_tokens=6)])
    assert batch[1].token_ids == alone.token_ids
    assert batch[1].text == alone.text
    again = embedded_llm.generate(STORY, seeded)[0]
    assert again.token_ids == alone.token_ids
    other = embedded_llm.generate(STORY, SamplingParams(temperature=1.0, max_tokens=6, seed=4321))[0]
    assert other.token_ids != alone.token_ids  # 6 tokens at temperature 1: a collision is ~impossible
    assert_idle(embedded_llm)


def test_unseeded_sampling_differs_between_requests(embedded_llm):
    params = SamplingParams(temperature=1.0, max_tokens=6)
    a, b = embedded_llm.generate([STORY, STORY], params)
    assert a.token_ids != b.token_ids  # each request draws its own seed
    assert_idle(embedded_llm)


# --- stop conditions --------------------------------------------------------------------------

def test_max_tokens_finishes_with_length(embedded_llm):
    out = embedded_llm.generate(STORY, SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5
    assert out.text == embedded_llm.tokenizer.decode(out.token_ids)
    assert out.prompt_token_ids == embedded_llm.tokenizer.encode(STORY)
    assert_idle(embedded_llm)


def test_eos_stops_and_chat_answers_paris(embedded_llm):
    out = embedded_llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < 24
    assert out.token_ids[-1] in embedded_llm.tokenizer.eos_token_ids
    assert out.token_ids.count(out.token_ids[-1]) == 1  # it stopped at the first EOS
    assert "<|im_end|>" not in out.text
    assert_idle(embedded_llm)


def test_ignore_eos_runs_to_max_tokens(embedded_llm):
    eos_ids = embedded_llm.tokenizer.eos_token_ids
    stopped = embedded_llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24))[0]
    assert stopped.finish_reason == "stop"
    n = len(stopped.token_ids) + 3
    out = embedded_llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == n
    assert out.token_ids[: len(stopped.token_ids)] == stopped.token_ids  # it went on past the EOS
    assert any(t in eos_ids for t in out.token_ids[:-1])
    assert_idle(embedded_llm)


def test_stop_token_ids_stop_without_the_token_in_text(embedded_llm):
    tok = embedded_llm.tokenizer
    free_run = embedded_llm.generate(STORY, SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    # the first token from position 2 on that has not appeared before: stopping on it cuts there
    cut = next(i for i in range(2, len(free_run)) if free_run[i] not in free_run[:i])
    stop = free_run[cut]
    out = embedded_llm.generate(STORY, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run[: cut + 1]
    assert out.text == tok.decode(free_run[:cut])
    assert out.text != tok.decode(free_run[: cut + 1])
    assert_idle(embedded_llm)


# --- admission control ------------------------------------------------------------------------

def test_too_long_for_the_model_is_rejected_before_running(embedded_llm):
    engine = embedded_llm.engine
    prompt = embedded_llm.tokenizer.encode(STORY)
    too_many = engine.max_model_len - len(prompt) + 1
    with pytest.raises(RequestRejected, match="context length") as info:
        engine.add_request(prompt, SamplingParams(max_tokens=too_many))
    assert isinstance(info.value, ValueError)
    assert_idle(embedded_llm)


def test_rejected_request_in_a_batch_queues_nothing(embedded_llm):
    engine = embedded_llm.engine
    with pytest.raises(RequestRejected):
        embedded_llm.generate([STORY, STORY], [SamplingParams(max_tokens=4),
                                               SamplingParams(max_tokens=engine.max_model_len)])
    assert_idle(embedded_llm)
    assert engine.step() == []


def test_empty_prompt_is_rejected(embedded_llm):
    with pytest.raises(ValueError):
        embedded_llm.engine.add_request([], SamplingParams(max_tokens=4))
    assert_idle(embedded_llm)


def test_out_of_vocab_prompt_ids_raise(embedded_llm):
    engine = embedded_llm.engine
    vocab = engine.hf_config.vocab_size
    for bad in ([1, 2, vocab], [1, -1], [vocab + 1000]):
        with pytest.raises(ValueError, match="prompt token ids"):
            engine.add_request(bad, SamplingParams(max_tokens=2))
    assert_idle(embedded_llm)
    out = embedded_llm.generate([[1, 2, vocab - 1]], SamplingParams(temperature=0, max_tokens=1))[0]
    assert len(out.token_ids) == 1  # the last id in the vocabulary is fine
    assert_idle(embedded_llm)


def test_duplicate_request_id_is_refused(embedded_llm):
    engine = embedded_llm.engine
    engine.add_request(STORY, SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="dup"):
        engine.add_request(STORY, SamplingParams(max_tokens=2), request_id="dup")
    engine.abort("dup")
    assert_idle(embedded_llm)


@pytest.fixture(scope="module")
def small_llm(embedded_path):
    """The embedded model with a 4-block (64-token) KV pool."""
    return LLM(str(embedded_path), progress=False, num_kv_blocks=4)


def test_request_larger_than_the_pool_is_rejected(embedded_llm, small_llm):
    engine = small_llm.engine
    assert engine.block_pool.num_blocks == 4
    block_size = engine.config.block_size
    prompt = small_llm.tokenizer.encode(STORY)
    fits = 4 * block_size - len(prompt)
    with pytest.raises(RequestRejected, match="KV") as info:
        engine.add_request(prompt, SamplingParams(max_tokens=fits + 1))
    assert isinstance(info.value, ValueError)
    assert_idle(small_llm)
    out = small_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert_idle(small_llm)
    assert_idle(embedded_llm)


def test_requests_wait_for_blocks_then_run(embedded_llm, small_llm):
    """Two requests of 3 blocks each on a 4-block pool: the second waits for the first's blocks."""
    prompts = [list(range(1000, 1040)), list(range(2000, 2040))]  # 40 tokens + 4 = 44 -> 3 blocks each
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = small_llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert_idle(small_llm)
    reference = embedded_llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert_idle(embedded_llm)


# --- abort and streaming ----------------------------------------------------------------------

def test_abort_mid_generation_frees_blocks_and_stops_output(embedded_llm):
    engine = embedded_llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    victim = engine.add_request(STORY, params)
    survivor = engine.add_request("The weather today is", SamplingParams(temperature=0, max_tokens=6))
    seen = []
    for _ in range(3):
        seen += [o.request_id for o in engine.step()]
    assert victim in seen and survivor in seen
    used_by_both = engine.block_pool.num_used
    assert used_by_both > 0
    engine.abort(victim)
    assert 0 < engine.block_pool.num_used < used_by_both
    engine.abort(victim)  # a second abort is a no-op
    engine.abort("no-such-request")
    outputs = drain(engine)
    assert victim not in outputs
    assert outputs[survivor][-1].finished
    assert len(outputs[survivor][-1].token_ids) == 6
    assert_idle(embedded_llm)


def test_abort_of_waiting_request(embedded_llm):
    engine = embedded_llm.engine
    request_id = engine.add_request(STORY, SamplingParams(max_tokens=4))
    assert engine.has_unfinished()
    engine.abort(request_id)
    assert engine.step() == []
    assert_idle(embedded_llm)


def test_streamed_deltas_add_up_to_the_final_text(embedded_llm):
    engine = embedded_llm.engine
    tok = embedded_llm.tokenizer
    emoji = tok.apply_chat_template([{"role": "user", "content": "Reply with three party emojis and nothing else."}])
    chinese = tok.apply_chat_template([{"role": "user", "content": "Translate to Chinese: good morning"}])
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=10)) for p in (emoji, chinese, STORY)]
    outputs = drain(engine)
    for request_id in ids:
        outs = outputs[request_id]
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert "".join(o.delta_text for o in outs) == final.text
        assert [t for o in outs for t in o.delta_token_ids] == final.token_ids
        # max_tokens may cut a character short: its bytes never reach the text, nor does U+FFFD
        full = tok.decode(final.token_ids)
        assert full.startswith(final.text)
        assert set(full[len(final.text):]) <= {"\ufffd"}
        if final.finish_reason == "stop" or request_id == ids[2]:
            assert final.text == full
        for n, o in enumerate(outs, 1):
            assert "\ufffd" not in o.delta_text
            assert o.text == "".join(x.delta_text for x in outs[:n])
    # the emoji / CJK answers really are multi-byte text built from byte-fallback tokens
    multibyte = [outputs[i][-1] for i in ids[:2]]
    assert all(any(ord(c) > 0x2E80 for c in out.text) for out in multibyte)
    assert all(any(not o.delta_text for o in outputs[i]) for i in ids[:2])
    assert_idle(embedded_llm)
