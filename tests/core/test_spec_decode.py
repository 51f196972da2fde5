"""Speculative decoding on the embedded model: lossless against decoding without it (greedy: the same
tokens; seeded sampling: the same tokens too, since deterministic drafts are verified with the very
draws plain sampling makes), inside continuous batching with prefix caching and preemption, with the
KV of rejected drafts rolled back and never read, and every KV block (the draft pool's too) freed. In fp32,
like the reference (embedded_llm): verifying 1 + k tokens at once rounds like decoding them one by one only
there; in bf16 a near-tie may flip, as in every engine."""

from __future__ import annotations

import pytest

from kvforge.core import LLM, SamplingParams
from kvforge.core.plugins import DraftTarget, Proposer
from tests.helpers.engine_helpers import drain

SYSTEM = "You are a careful assistant. When asked to repeat or fix a text, copy it exactly except for the fix."
TASKS = [
    "Repeat this code exactly:\ndef area(width, height):\n    return width * height\n\nprint(area(3, 4))",
    "Fix the typo and return the whole sentence: The quick brown fox jumpd over the lazy dog near the river.",
    "Copy this list as is: apples, pears, plums, cherries, apples, pears, plums, cherries.",
    "What is the capital of France?",
    "Repeat: to be or not to be, that is the question; to be or not to be, that is the question.",
    "Rewrite in upper case: hello world, hello world, hello world.",
    "Write a haiku about autumn leaves.",
    "Return this JSON unchanged: {\"name\": \"kvforge\", \"version\": 1, \"name2\": \"kvforge\"}",
]
# per-request settings that all depend on the output so far: each draft position must see its own history
PARAMS = [
    dict(), dict(logprobs=3), dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.3),
    dict(min_tokens=20), dict(stop=["world, hello"]), dict(max_tokens=7), dict(),
]
# three replies run to the limit (speculation's long accepted runs are there), the five others end by themselves
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(embedded_llm):
    tok = embedded_llm.tokenizer
    return [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}])
            for t in TASKS]


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(**({"temperature": 0, "max_tokens": MAX_TOKENS} | p)) for p in PARAMS]


@pytest.fixture(scope="module")
def reference(embedded_llm, prompts):
    """Plain decoding (no speculation) of the same batch."""
    return embedded_llm.generate(prompts, greedy_params())


def assert_no_blocks_in_use(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.block_pool.num_used == 0
    if engine.speculator is not None:
        assert engine.speculator.proposer.kv_blocks_used() == 0
        assert not getattr(engine.speculator.proposer, "mirrors", {})


def assert_same_outputs(outs, reference) -> None:
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.token_ids == ref.token_ids, f"prompt {i}: {out.text!r} != {ref.text!r}"
        assert out.text == ref.text and out.finish_reason == ref.finish_reason
        if ref.logprobs is not None:
            assert [lp.token_id for lp in out.logprobs] == out.token_ids
            for ours, theirs in zip(out.logprobs, ref.logprobs):
                assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-3)
                assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]


SPEC_CONFIGS = {
    "ngram": dict(decoding="ngram", decoding_options={"min_n": 1, "max_batch_size": 8}),
    "ngram-tiny-kv-pool": dict(decoding="ngram", decoding_options={"max_batch_size": 8}, num_kv_blocks=24),
    "ngram-tiny-budget": dict(decoding="ngram", decoding_options={"max_batch_size": 8}, max_num_batched_tokens=24),
    "draft-layers": dict(decoding="draft", decoding_options={"layers": 10, "max_batch_size": 8}),
    "draft-model": dict(decoding="draft", decoding_options={"model": "EMBEDDED", "k": 3, "max_batch_size": 8}),
}


@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_greedy_outputs_identical_in_one_batch(name, embedded_path, prompts, reference):
    config = SPEC_CONFIGS[name]
    if config["decoding_options"].get("model") == "EMBEDDED":
        config = config | {"decoding_options": config["decoding_options"] | {"model": str(embedded_path)}}
    llm = LLM(str(embedded_path), progress=False, dtype="float32", kv_cache_bytes=128 << 20, **config)
    # a second round's prompts hit the prefix cache: run for the n-gram and the draft-model proposer; the tiny pool,
    # the tiny budget and the layers drafter make their points in the first round
    for round_ in range(2 if name in ("ngram", "draft-model") else 1):
        outs = llm.generate(prompts, greedy_params())
        assert_same_outputs(outs, reference)
        assert_no_blocks_in_use(llm)
        if round_:
            assert all(o.num_cached_tokens > 0 for o in outs)
    stats = llm.engine.stats()
    assert stats.spec_drafted_tokens_total > 0 and stats.spec_accepted_tokens_total > 0
    assert 0 < stats.spec_acceptance_rate <= 1
    k = llm.engine.config.decoding_options["k"]
    assert 1 < stats.spec_mean_accepted_length <= k + 1
    if "tiny-kv-pool" in name:
        assert stats.preemptions_total > 0
    speculated = [o.metrics for o in outs if o.metrics["spec_drafted_tokens"]]
    assert speculated and all(0 <= m["spec_acceptance_rate"] <= 1 for m in speculated)


SELF_DRAFTING_K = 4


@pytest.fixture(scope="module")
def self_drafting(embedded_path):
    """The target drafting for itself (k = 4), by a second copy of the model ("model") or by all 30 of its own layers
    ("layers"): each built once for the module's tests that need it. Every test leaves it idle with no block in use
    (its own last assertion), so the next one finds it as built but for the prefix cache and the stats' totals."""
    built = {}

    def get(drafter: str) -> LLM:
        if drafter not in built:
            source = {"model": str(embedded_path)} if drafter == "model" else {"layers": 30}
            built[drafter] = LLM(str(embedded_path), progress=False, dtype="float32", kv_cache_bytes=128 << 20,
                                 decoding="draft",
                                 decoding_options=source | {"k": SELF_DRAFTING_K, "max_batch_size": 8})
        return built[drafter]
    return get


@pytest.mark.parametrize("drafter", ["model", "layers"])
def test_draft_equal_to_target_accepts_every_draft(drafter, self_drafting, prompts):
    """The target drafting for itself at temperature 0: every draft is accepted, k + 1 tokens per step (the engine's
    acceptance totals too: whatever ran on it before was accepted whole, or they would not be 1.0)."""
    k = SELF_DRAFTING_K
    llm = self_drafting(drafter)
    # 1 token from the prompt's forward, then 6 verification steps of k + 1 tokens
    params = SamplingParams(temperature=0, max_tokens=1 + 6 * (k + 1), ignore_eos=True)
    outs = llm.generate(prompts[:4], params)
    for out in outs:
        assert out.metrics["spec_acceptance_rate"] == 1.0
        assert out.metrics["spec_mean_accepted_length"] == k + 1
        assert out.metrics["spec_drafted_tokens"] == 6 * k
    stats = llm.engine.stats()
    assert stats.spec_acceptance_rate == 1.0 and stats.spec_mean_accepted_length == k + 1
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize("name", ["ngram", "draft-sample"])
def test_seeded_sampling_is_reproducible(name, embedded_llm, embedded_path, prompts):
    options = {"max_batch_size": 8} | ({"layers": 8, "sample": True} if name == "draft-sample" else {})
    llm = LLM(str(embedded_path), progress=False, dtype="float32", kv_cache_bytes=128 << 20,
              decoding="ngram" if name == "ngram" else "draft", decoding_options=options)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=24) for i in range(4)]
    alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts[:4], params)]
    batched = [o.token_ids for o in llm.generate(prompts[:4], params)]
    assert alone == batched
    assert llm.engine.stats().spec_drafted_tokens_total > 0
    if name == "ngram":  # deterministic drafts are verified with plain sampling's own draws
        plain = [o.token_ids for o in embedded_llm.generate(prompts[:4], params)]
        assert batched == plain
    assert_no_blocks_in_use(llm)


class OracleWithErrors(Proposer):
    """Drafts the reference continuation for a few tokens, then wrong tokens, so every step accepts
    part of its drafts and rolls back the rest in the middle of a block."""

    name = "oracle-with-errors"

    def __init__(self, target: DraftTarget, continuations: dict[tuple[int, ...], list[int]], **options) -> None:
        super().__init__(target, **options)
        self.continuations, self.calls = continuations, 0

    def propose(self, seqs, num_tokens):
        drafts = []
        for seq, k in zip(seqs, num_tokens):
            self.calls += 1
            right = self.continuations[tuple(seq.prompt_token_ids)][len(seq.output_token_ids):]
            good = self.calls % (k + 1)
            wrong = [(t + 7) % 1000 for t in right[good:k]]
            drafts.append((right[:good] + wrong)[:k])
        return drafts


def test_rejected_drafts_leave_no_stale_kv(embedded_path, prompts, reference):
    """Wrong drafts' K/V stay in the cache past the sequence's end after each rollback; the positions
    past the end are also overwritten with large garbage after every step. Tokens still equal the
    reference, so nothing reads K/V past a sequence's computed tokens before rewriting it."""
    llm = LLM(str(embedded_path), progress=False, dtype="float32", kv_cache_bytes=128 << 20, decoding="ngram",
              decoding_options={"k": 5, "adaptive": False, "max_batch_size": 8})
    engine = llm.engine
    continuations = {tuple(p): r.token_ids for p, r in zip(prompts, reference)}
    engine.speculator.proposer = OracleWithErrors(engine.speculator.proposer.target, continuations, k=5)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, greedy_params())]
    finals = {}
    size, cache = engine.config.block_size, engine.runner.kv_cache
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        for seq in engine.scheduler.running:
            end = seq.num_computed_tokens
            if end % size and end // size < len(seq.block_table):
                cache[:, :, :, seq.block_table[end // size], end % size:] = 1e4
            for block in seq.block_table[-(-end // size):]:
                cache[:, :, :, block] = 1e4
    for request_id, ref in zip(ids, reference):
        assert finals[request_id].token_ids == ref.token_ids
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_drafted_tokens_total
    assert_no_blocks_in_use(llm)


def test_abort_while_speculating_frees_every_block(self_drafting, prompts):
    llm = self_drafting("layers")
    engine = llm.engine
    drafted = engine.stats().spec_drafted_tokens_total
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)) for p in prompts]
    for _ in range(4):
        engine.step()
    assert engine.speculator.proposer.kv_blocks_used() > 0
    assert engine.stats().spec_drafted_tokens_total > drafted
    for request_id in ids:
        engine.abort(request_id)
    assert_no_blocks_in_use(llm)


def test_no_speculation_above_max_batch_size(embedded_path, prompts):
    llm = LLM(str(embedded_path), progress=False, dtype="float32", kv_cache_bytes=128 << 20, decoding="ngram",
              decoding_options={"max_batch_size": 3, "min_n": 1})
    engine = llm.engine
    for p in prompts[:4]:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    engine.step()  # the four prompts
    for _ in range(5):  # four decoding sequences > 3: plain decoding
        engine.step()
        assert engine.stats().spec_drafted_tokens_total == 0
    drain(engine)


def test_decoding_options_are_validated(embedded_path):
    for decoding, options, expected in [
        ("ngram", {"k": 0}, "'k'"), ("ngram", {"min_n": 3, "max_n": 2}, "min_n"),
        ("ngram", {"lookahead": 2}, "no option 'lookahead'"), ("draft", {}, "exactly one of option 'model'"),
        ("draft", {"layers": 99}, "'layers'"), ("warp", {}, "unknown kvforge.decoding plugin 'warp'"),
    ]:
        with pytest.raises(ValueError, match=expected):
            LLM(str(embedded_path), progress=False, num_kv_blocks=8, decoding=decoding, decoding_options=options)


def test_draft_model_rolls_back_its_rejected_drafts(self_drafting, prompts):
    """After a rejection the drafter's own KV past the shared prefix is dropped: its next drafts equal those
    of a drafter that never saw the rejected ones."""
    from kvforge.core.request import Sequence

    proposer = self_drafting("model").engine.speculator.proposer
    assert proposer.kv_blocks_used() == 0
    seq = Sequence("mirror", prompts[0], SamplingParams(temperature=0))
    seq.output_token_ids = [proposer.propose([seq], [1])[0].token_ids[0]]
    first = proposer.propose([seq], [4])[0].token_ids
    seq.output_token_ids += [first[0], (first[1] + 1) % 1000]  # one draft accepted, the second rejected
    after_rollback = proposer.propose([seq], [4])[0].token_ids
    proposer.release(seq)
    fresh = proposer.propose([seq], [4])[0].token_ids
    assert after_rollback == fresh
    proposer.release(seq)
    assert proposer.kv_blocks_used() == 0
