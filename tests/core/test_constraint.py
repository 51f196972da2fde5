"""Constrained decoding in the core (core/constraint.py): outputs match their constraint under batching with
free sequences, n > 1, preemption and n-gram speculation; free outputs are unchanged by constrained
neighbours; drafts are masked and checked without moving the grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.core import LLM, SamplingParams
from kvforge.core.constraint import Constraint, InvalidConstraint, apply_token_masks, closed_objects
from tests.helpers.engine_helpers import assert_idle

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
FREE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 48, **kw})


def valid_json(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_json_schema_output_validates_and_stops(embedded_llm):
    out = embedded_llm.chat(CHAT, greedy(constraint=Constraint.json_schema(PERSON)))[0]
    assert out.finish_reason == "stop"
    assert list(valid_json(out.text, PERSON)) == ["name", "age"]  # the schema's property order
    assert_idle(embedded_llm)


def test_choice_regex_and_any_object(embedded_llm):
    llm = embedded_llm
    out = llm.chat([{"role": "user", "content": "Is the sky blue? yes or no"}],
                   greedy(constraint=Constraint.choice(["yes", "no", "maybe not"])))[0]
    assert out.text in ("yes", "no", "maybe not") and out.finish_reason == "stop"
    out = llm.generate(["My phone number is"], greedy(constraint=Constraint.regex(r"\(\d{3}\) \d{3}-\d{4}")))[0]
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", out.text) and out.finish_reason == "stop"
    out = llm.chat(CHAT, greedy(max_tokens=200, constraint=Constraint.json_object()))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


def test_grammar_constraint(embedded_llm):
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    out = embedded_llm.generate(["Question: what is 6 times 7?\n"], greedy(constraint=Constraint.grammar(lark)))[0]
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", out.text), out.text


@pytest.mark.parametrize("constraint", [Constraint.regex("(unclosed"), Constraint.grammar("start: undefined_rule"),
                                        Constraint.json_schema({"type": "no-such-type"})])
def test_a_constraint_that_does_not_compile_is_refused_before_queueing(embedded_llm, constraint):
    with pytest.raises(InvalidConstraint):
        embedded_llm.engine.add_request("Hello", greedy(constraint=constraint))
    assert not embedded_llm.engine.has_unfinished()


def test_free_outputs_unchanged_beside_constrained_ones(embedded_llm):
    """One batch mixing free greedy prompts, constrained greedy ones and constrained samples (n = 3): the free
    ones equal their outputs alone, every constrained one validates."""
    llm = embedded_llm
    alone = llm.generate(FREE_PROMPTS, greedy())
    engine = llm.engine
    free_ids = [engine.add_request(p, greedy()) for p in FREE_PROMPTS]
    prompt = engine.tokenizer.apply_chat_template(CHAT)
    constrained_ids = [engine.add_request(prompt, greedy(constraint=Constraint.json_schema(PERSON))),
                       engine.add_request(prompt, SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=64,
                                                                 constraint=Constraint.json_schema(PERSON)))]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[(out.request_id, out.index)] = out
    for request_id, ref in zip(free_ids, alone):
        assert finals[(request_id, 0)].token_ids == ref.token_ids
    samples = [finals[(constrained_ids[1], i)] for i in range(3)]
    for out in [finals[(constrained_ids[0], 0)], *samples]:
        assert out.finish_reason == "stop"
        valid_json(out.text, PERSON)
    assert len({o.text for o in samples}) > 1  # each sample has its own grammar state and draws
    assert_idle(llm)


def test_preemption_recompute_keeps_the_grammar(embedded_path, embedded_llm):
    """A KV pool so small that sequences are preempted mid-output and recomputed: the constrained outputs
    are those of an unhurried run."""
    prompts = [f"Describe person number {i} as JSON with a name and an age." for i in range(6)]
    params = greedy(max_tokens=40, constraint=Constraint.json_schema(PERSON))
    chats = [embedded_llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    reference = embedded_llm.generate(chats, params)
    small = LLM(str(embedded_path), progress=False, dtype="float32", num_kv_blocks=14, block_size=16)
    outs = small.generate(chats, params)
    assert small.engine.stats().preemptions_total > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    for out in outs:
        if out.finish_reason == "stop":
            valid_json(out.text, PERSON)


ITEMS = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 4, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "maximum": 99}, "tag": {"enum": ["a", "b"]}},
    "required": ["id", "tag"], "additionalProperties": False}}}, "required": ["items"]}
ITEMS_CHAT = [{"role": "user", "content": "List four items as JSON: each has an id and a tag."}]


@pytest.fixture(scope="module")
def items_without_speculation(embedded_llm):
    """The greedy constrained reply to ITEMS_CHAT without speculation (one run for every drafter compared with it)."""
    return embedded_llm.chat(ITEMS_CHAT, greedy(max_tokens=110, constraint=Constraint.json_schema(ITEMS)))[0]


@pytest.mark.parametrize("decoding, options", [("ngram", {"min_n": 1, "max_batch_size": 8}),
                                               ("draft", {"layers": 20, "k": 3, "max_batch_size": 8})])
def test_speculation_under_a_constraint(embedded_path, items_without_speculation, decoding, options):
    """Drafts (n-gram, or a drafter that samples them with probabilities) are checked against the grammar before
    verification and masked per draft position: greedy constrained outputs equal those without speculation,
    drafts were verified and accepted, sampled ones validate."""
    schema, chat = ITEMS, ITEMS_CHAT
    params = greedy(max_tokens=110, constraint=Constraint.json_schema(schema))
    reference = items_without_speculation
    spec = LLM(str(embedded_path), progress=False, dtype="float32", kv_cache_bytes=128 << 20, decoding=decoding,
               decoding_options=options)
    out = spec.chat(chat, params)[0]
    assert out.token_ids == reference.token_ids
    valid_json(out.text, schema)
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens_total > 0
    sampled = spec.chat(chat, SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=110,
                                             constraint=Constraint.json_schema(schema)))[0]
    for sample in sampled:
        if sample.finish_reason == "stop":
            valid_json(sample.text, schema)


def test_drafts_are_masked_and_checked_without_moving_the_grammar(embedded_llm):
    grammars = embedded_llm.engine.grammars
    tokenizer = embedded_llm.engine.tokenizer
    state = grammars.start(Constraint.json_schema(PERSON))
    text_ids = tokenizer.hf.encode('{"name": "Ann", "age": 7}', add_special_tokens=False)
    assert state.valid_drafts([], text_ids + [11]) == len(text_ids)  # a token after the end is refused
    bitmask = torch.full((len(text_ids) + 1, grammars.mask_words()), -1, dtype=torch.int32)
    state.fill_masks(bitmask, 0, [], text_ids)
    for j, token in enumerate(text_ids):  # each row: the mask after consuming the drafts before it
        fresh = grammars.start(Constraint.json_schema(PERSON))
        assert fresh.matcher.consume_tokens(text_ids[:j])
        one = torch.full((1, grammars.mask_words()), -1, dtype=torch.int32)
        fresh.fill_masks(one, 0, [], [])
        assert torch.equal(one[0], bitmask[j])
        assert bitmask[j, token // 32] >> (token % 32) & 1
    assert state.matcher.validate_tokens(text_ids) == len(text_ids)  # still at the start
    assert not state.matcher.is_accepting()


def test_token_masks_apply_bit_for_bit():
    vocab, rows = 70, 3
    allowed = torch.rand(rows, vocab) < 0.3
    words = torch.zeros(rows, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(rows, vocab)
    expected = logits.masked_fill(~allowed, float("-inf"))
    expected[1] = logits[1]
    apply_token_masks(logits, [0, 2], bitmask)
    assert torch.equal(logits, expected)


def test_constraint_opens_after_its_marker(embedded_llm):
    """A reasoning model's structured output starts after the thinking ends: the tokens up to the marker are
    the free output's, what follows matches the schema. The marker here is text the free output contains."""
    llm = embedded_llm
    free = llm.chat(CHAT, greedy(max_tokens=12))[0]
    marker = free.token_ids[3:5]
    constraint = Constraint.json_schema(PERSON).opened_by(marker)
    out = llm.chat(CHAT, greedy(max_tokens=60, constraint=constraint))[0]
    assert out.token_ids[:5] == free.token_ids[:5]
    after = llm.engine.tokenizer.decode(out.token_ids[5:])
    assert out.finish_reason == "stop"
    valid_json(after, PERSON)


def test_logit_bias(embedded_llm):
    llm = embedded_llm
    free = llm.generate(["The capital of France is"], greedy(max_tokens=3))[0]
    banned = llm.generate(["The capital of France is"],
                          greedy(max_tokens=3, logit_bias={free.token_ids[0]: -100}))[0]
    assert banned.token_ids[0] != free.token_ids[0]
    forced = llm.generate(["The capital of France is"], greedy(max_tokens=3, logit_bias={1234: 100}))[0]
    assert forced.token_ids == [1234] * 3
    with pytest.raises(ValueError, match="logit_bias"):
        llm.engine.add_request("Hi", greedy(logit_bias={10**9: 1}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101})


SCALARS = st.sampled_from([
    {"type": "string", "maxLength": 12}, {"type": "integer", "minimum": -50, "maximum": 50}, {"type": "boolean"},
    {"enum": ["red", "green", "blue"]}, {"type": "number", "minimum": 0, "maximum": 10},
    {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 3},
    {"type": "string", "pattern": "^[a-z]{2,5}$"}, {"type": ["string", "null"], "maxLength": 6},
])
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


@st.composite
def object_schemas(draw, depth=0):
    properties = draw(st.dictionaries(NAMES, SCALARS if depth else st.one_of(SCALARS, object_schemas(depth=1)),
                                      min_size=1, max_size=4))
    required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@settings(max_examples=6, deadline=None, derandomize=True,  # the same schemas every run: CI cannot flake on one
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=object_schemas(), seed=st.integers(0, 2**31))
def test_generated_schemas_always_validate(embedded_llm, schema, seed):
    """Every finished constrained output validates against its (generated) schema: sampled, several at once."""
    params = SamplingParams(temperature=1.0, seed=seed, n=4, max_tokens=200,
                            constraint=Constraint.json_schema(schema))
    prompt = [{"role": "user", "content": f"Answer with JSON for this schema: {json.dumps(schema)}"}]
    samples = embedded_llm.chat(prompt, params)[0]
    finished = [s for s in samples if s.finish_reason == "stop"]
    assert finished, [s.text for s in samples]
    for sample in finished:
        valid_json(sample.text, schema)


# ---- objects that list properties are closed (llama.cpp's and xgrammar's reading) ----


def allows(llm, constraint: Constraint, text: str) -> bool:
    """Whether the constraint lets the model write `text` and then stop."""
    matcher = llm.engine.grammars.start(constraint).matcher
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_an_object_with_properties_takes_no_other_keys_unless_it_says_so(embedded_llm):
    """What pydantic emits (no additionalProperties) means these keys: a model must not add keys until max_tokens."""
    open_ = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert allows(embedded_llm, Constraint.json_schema(open_), '{"name": "Ada"}')
    assert not allows(embedded_llm, Constraint.json_schema(open_), '{"name": "Ada", "age": 36}')
    said = {**open_, "additionalProperties": True}
    assert allows(embedded_llm, Constraint.json_schema(said), '{"name": "Ada", "age": 36}')
    typed = {**open_, "additionalProperties": {"type": "integer"}}
    assert allows(embedded_llm, Constraint.json_schema(typed), '{"name": "Ada", "age": 36}')
    assert not allows(embedded_llm, Constraint.json_schema(typed), '{"name": "Ada", "age": "old"}')
    no_properties = {"type": "object"}  # any object: nothing listed, nothing closed
    assert allows(embedded_llm, Constraint.json_schema(no_properties), '{"age": 36}')


def test_closed_objects_walks_a_pydantic_schema():
    from pydantic import BaseModel

    class Address(BaseModel):
        city: str

    class Person(BaseModel):
        name: str
        home: Address
        past: list[Address]
        work: Address | None = None

    schema = Person.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Address"]["additionalProperties"] is False
    assert closed["properties"] == schema["properties"]  # refs and unions kept as they are
    jsonschema.validate({"name": "a", "home": {"city": "b"}, "past": []}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "a", "home": {"city": "b", "zip": 1}, "past": []}, closed)
    inline = {"type": "array", "items": {"properties": {"a": {"anyOf": [{"properties": {"b": {}}}, {"type": "null"}]}}},
              "prefixItems": [{"properties": {"c": {}}}]}
    closed = closed_objects(inline)
    assert closed["items"]["additionalProperties"] is False
    assert closed["items"]["properties"]["a"]["anyOf"][0]["additionalProperties"] is False
    assert closed["prefixItems"][0]["additionalProperties"] is False
    # an allOf's members each list part of one object's keys; an object that says what else it takes keeps it
    merged = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_objects(merged) == merged
    patterned = {"properties": {"a": {}}, "patternProperties": {"^x": {}}}
    assert closed_objects(patterned) == patterned
