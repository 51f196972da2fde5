"""A model's sampling defaults (core/generation_defaults.py) and the repetition guard (core/repetition.py): where
the defaults come from (generation_config.json, the family table, the user's over both), what the offline API does
with them, and the guard ending a real greedy loop of the embedded model without changing a token before it."""

from __future__ import annotations

import json
import shutil

import pytest

from kvforge.core import SamplingParams
from kvforge.core.generation_defaults import GenerationDefaults, model_generation_defaults
from kvforge.core.repetition import MIN_REPEATS, MIN_SPAN, RepetitionGuard


def checkpoint(tmp_path, name: str, generation_config: dict | None = None, config: dict | None = None):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_generation_config_first_then_the_family_then_none(tmp_path):
    # Qwen2.5-Instruct's generation_config.json, as shipped (HF's names; do_sample and the token ids are not ours)
    qwen = checkpoint(tmp_path, "Qwen2.5-0.5B-Instruct", {"bos_token_id": 151643, "do_sample": True,
                                                          "eos_token_id": [151645, 151643], "repetition_penalty": 1.1,
                                                          "temperature": 0.7, "top_p": 0.8, "top_k": 20})
    assert model_generation_defaults(qwen) == GenerationDefaults(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}, "generation_config.json")
    # a generation_config.json with only token ids (SmolLM2's own) leaves it to the family table, matched on the
    # directory, the source it was converted from, or the config's _name_or_path
    smol = checkpoint(tmp_path, "SmolLM2-360M-Instruct", {"eos_token_id": 2})
    family = GenerationDefaults({"temperature": 0.2, "top_p": 0.9}, "SmolLM2 model card")
    assert model_generation_defaults(smol) == family
    converted = checkpoint(tmp_path, "abc123", {"eos_token_id": 2})
    assert model_generation_defaults(converted, ["/models/SmolLM2-360M-Instruct.Q8_0.gguf"]) == family
    # the embedded Q4_1 conversion has an entry of its own, before the family's (measured: greedy)
    embedded = GenerationDefaults({"temperature": 0.0}, "kvforge bench defaults (embedded Q4_1)")
    assert model_generation_defaults(converted, [None, "/x/SmolLM2-135M-Instruct.Q4_1.gguf"]) == embedded
    named = checkpoint(tmp_path, "x", None, {"_name_or_path": "HuggingFaceTB/SmolLM2-1.7B-Instruct"})
    assert model_generation_defaults(named) == family
    assert model_generation_defaults(checkpoint(tmp_path, "SmolLM2-135M", None)) == GenerationDefaults()  # base
    assert model_generation_defaults(checkpoint(tmp_path, "tiny", None), [None, "tiny-a"]) == GenerationDefaults()
    # max_new_tokens is a default max_tokens
    long = checkpoint(tmp_path, "long", {"max_new_tokens": 2048, "temperature": 0.6})
    assert model_generation_defaults(long).values == {"temperature": 0.6, "max_tokens": 2048}


def test_bad_defaults_fail_at_load_naming_the_field(tmp_path):
    bad = checkpoint(tmp_path, "bad", {"temperature": -1})
    with pytest.raises(ValueError, match=r"generation_config.json: temperature must be"):
        model_generation_defaults(bad)
    with pytest.raises(ValueError, match="unknown fields seed"):
        GenerationDefaults({"seed": 1})
    with pytest.raises(ValueError, match="top_p must be"):
        GenerationDefaults({"top_p": 2})


def test_the_users_defaults_go_over_the_models_field_by_field():
    model = GenerationDefaults({"temperature": 0.2, "top_p": 0.9}, "SmolLM2 model card")
    merged = GenerationDefaults({"temperature": 0.5, "top_k": 40}, "settings").over(model)
    assert merged == GenerationDefaults({"temperature": 0.5, "top_p": 0.9, "top_k": 40},
                                        "settings over SmolLM2 model card")
    assert GenerationDefaults({}, "settings").over(model) is model
    assert GenerationDefaults({"top_k": 5}, "settings").over(GenerationDefaults()).source == "settings"
    params = merged.params(temperature=0, max_tokens=3)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0, 0.9, 40, 3)


def test_an_engine_reads_its_checkpoints_defaults(embedded_llm, embedded_path, tmp_path):
    """The embedded model (the README's default) decodes greedily by default (its table entry); a
    generation_config.json that sets some fields wins; the settings' sampling_defaults go over either."""
    assert embedded_llm.engine.generation_defaults == GenerationDefaults(
        {"temperature": 0.0}, "kvforge bench defaults (embedded Q4_1)")
    assert embedded_llm.default_sampling_params().greedy
    copy = tmp_path / "my-model"
    shutil.copytree(embedded_path, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.6, "top_k": 20}))
    from kvforge.core import LLM

    llm = LLM(str(copy), progress=False, num_kv_blocks=8, dtype="float32", sampling_defaults={"top_k": 10})
    try:
        assert llm.engine.generation_defaults == GenerationDefaults(
            {"temperature": 0.6, "top_k": 10}, "settings over generation_config.json")
    finally:
        llm.engine.close()


def test_the_guard_finds_loops_and_passes_short_repeats():
    def first_loop(tokens: list[int]) -> int | None:
        guard = RepetitionGuard()
        return next((i for i, token in enumerate(tokens, 1) if guard.looping(token)), None)

    assert first_loop([7] * 100) == MIN_SPAN  # one token over and over
    cycle = [1, 2, 3]
    assert first_loop([9, 8] + cycle * 40) == 2 + MIN_SPAN  # a short cycle: the whole span
    sentence = list(range(100, 130))  # 30 tokens, repeated: MIN_REPEATS times
    assert first_loop(list(range(50)) + sentence * 6) == 50 + MIN_REPEATS * len(sentence)
    # "ha ha ha", a table's rule, then varied text: no loop
    assert first_loop([5, 6] * 10 + list(range(200, 400)) + [4] * 20 + list(range(400, 600))) is None
    # a long output keeps only its tail, and still finds a loop late in it
    assert first_loop(list(range(1000, 3000)) + [1, 2] * 40) == 2000 + MIN_SPAN


def test_the_guard_ends_a_real_greedy_loop_without_changing_a_token(embedded_llm):
    prompt = "1, 2, 1, 2, 1, 2, 1, 2,"  # the embedded model continues this greedily forever
    guarded = embedded_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=80, repetition_guard=True))[0]
    assert guarded.finish_reason == "repetition"
    assert len(guarded.token_ids) == MIN_SPAN
    plain = embedded_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MIN_SPAN))[0]
    assert plain.token_ids == guarded.token_ids and plain.finish_reason == "length"
    # text that does not loop runs as without the guard
    story = embedded_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40,
                                                                      repetition_guard=True))[0]
    assert story.finish_reason == "length"
