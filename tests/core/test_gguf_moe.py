"""Mixture-of-experts GGUF files in llama.cpp's layout (core/gguf_moe.py): tiny Qwen2-MoE (shared expert), Qwen3-MoE,
Mixtral (architecture llama, Q / K rows permuted) and OLMoE (whole-projection q/k norms) models written as GGUF
(tests/helpers/moe_gguf.py) give HF transformers' greedy tokens (fp32) served in place, each expert's slice of the
stacked tensors a view of the file, and converted dense (--gguf-dense); each family with F32 experts or Q8_0 ones (HF
then runs on the dequantized weights). transformers' reader makes the Qwen files' config, Mixtral's and OLMoE's are
made from the metadata. Files with experts of another architecture are refused with one line."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from kvforge.app.models.catalog import describe
from kvforge.core import LLM, SamplingParams
from kvforge.core.loader import resolve_model
from tests.helpers.moe_gguf import write_moe_gguf
from tests.helpers.parity import compare, hf_greedy
from tests.helpers.tiny_models import random_prompts, save_tiny_model, tiny_configs

NEW_TOKENS = 16
T = GGMLQuantizationType
# each family once (a file is indexed and converted in seconds: its 49152-token vocabulary): F32 experts (the file's
# values are HF's own) or Q8_0 ones
CASES = {"qwen2_moe-f32": ("qwen2_moe", T.F32), "qwen3_moe-q8_0": ("qwen3_moe", T.Q8_0),
         "mixtral-q8_0": ("mixtral", T.Q8_0), "olmoe-f32": ("olmoe", T.F32)}
# what llama.cpp's files of the family hold: experts in every layer (its qwen2moe has no dense layer), no q/k/v
# clipping (OLMoE's converter writes none)
AS_LLAMA_CPP_WRITES = {"qwen2_moe": {"mlp_only_layers": []}, "olmoe": {"clip_qkv": None}}


@pytest.fixture(scope="module", params=list(CASES))
def moe_file(request, tmp_path_factory, embedded_path):
    """(case, GGUF path, expert type, expert count, prompts, HF's greedy tokens and logits on the file's weights)."""
    family, experts = CASES[request.param]
    config = tiny_configs()[family]
    for field, value in AS_LLAMA_CPP_WRITES.get(family, {}).items():
        setattr(config, field, value)
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(family, path / "hf", embedded_path, seed=1234, config=config)
    gguf = write_moe_gguf(model, path / f"{request.param}.gguf", experts)
    prompts = random_prompts((1, 5, 17, 40), seed=7)
    count = getattr(config, "num_local_experts", None) or config.num_experts
    return (request.param, gguf, experts, count, prompts,
            hf_greedy(model, prompts, NEW_TOKENS, pad_id=0, eos_ids={2}))


@pytest.mark.parametrize("dense", [False, True], ids=["in_place", "gguf_dense"])
def test_greedy_tokens_match_hf(moe_file, dense, embedded_path):
    from kvforge.core.tokenizer import Tokenizer

    name, gguf, experts, count, prompts, reference = moe_file
    # in place: x meets the experts' blocks in fp32 (the int16 activations are a separate, approximate choice)
    options = {} if dense else {"quant_options": {"activations": "fp32"}}
    llm = LLM(str(gguf), progress=False, dtype="float32", num_kv_blocks=128, gguf_dense=dense, **options)
    try:
        model = llm.engine.runner.model
        assert model.config.model_type == name.split("-")[0]
        # the file's tokenizer (the embedded model's fields; OLMoE's read without its architecture) encodes as that one
        text = "Hello world, héllo 東京 🙂 def f(x): return x"
        assert llm.tokenizer.encode(text) == Tokenizer(embedded_path).encode(text)
        block = model.model.layers[0].mlp
        assert len(block.experts) == count and block.experts[0].down_proj.in_features == 32
        assert (block.shared_expert is not None) == name.startswith("qwen2_moe")
        if not dense:  # every expert's gate/up and down: its own slice of the file's one mapping (or copy)
            layers = [m for e in block.experts for m in (e.gate_up_proj, e.down_proj)]
            assert {q for m in layers for q, _ in m.segments.parts} == {int(experts)}
            views = [b for m in layers for _, b in m.segments.parts]
            assert len({b.data_ptr() for b in views}) == len(views) == 3 * count
            assert len({b.untyped_storage().data_ptr() for b in views}) == 1
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
        report = compare([o.token_ids for o in outs], *reference)
        print(name, "dense" if dense else "in place", report)
        assert report.exact >= len(prompts) - 1, report
    finally:
        llm.engine.close()


def test_routed_experts_in_one_call_give_one_call_each_bits(moe_file):
    """Served in place with the default activations (int16 x in decode steps), a step whose experts take few rows runs
    them in two kernel calls per layer (gguf_experts_linear, counted under torch's profiler) and gives the tokens and
    log-probabilities of one call per expert bit for bit; prefill (more rows than int16 takes) keeps one call each.
    F32 experts (float weights: x as given) never take it. The catalog's estimate of the experts' bytes is what the
    loaded model places."""
    import torch

    name, gguf, experts, _, prompts, _ = moe_file
    # no prefix cache: the second run would compute only each prompt's last token, in int16 where the first took
    # the prompt's rows as given
    llm = LLM(str(gguf), progress=False, dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    try:
        blocks = [layer.mlp for layer in llm.engine.runner.model.model.layers]
        # `kvforge models` / the UI's estimate count the experts the loaded model holds, before loading
        (stage,) = llm.engine.runtime().stages
        assert describe(gguf.name, gguf, 64, "float32").experts_bytes == stage["experts_bytes"] > 0
        if experts == T.F32:
            assert all(block.stacked is None for block in blocks)
            return
        assert all(block.stacked is not None for block in blocks)
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
        # one sequence: each decode step gives an expert one row, which `auto` quantizes on any CPU where int16 wins
        # at all (how many rows it takes is timed per machine: a batch's steps may go past it)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            llm.generate(prompts[:1], params)
        calls = sum(event.count for event in profile.key_averages() if event.key == "kvforge::gguf_experts_linear")
        assert calls >= 2 * len(blocks) * 7  # at least the 7 decode steps after the prompt's first token
        together = llm.generate(prompts, params)
        for block in blocks:
            block.stacked = None
        alone = llm.generate(prompts, params)
        for a, b in zip(together, alone):
            assert a.token_ids == b.token_ids
            assert [(p.logprob, p.top) for p in a.logprobs] == [(p.logprob, p.top) for p in b.logprobs]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("arch", ["deepseek2", "gpt-oss"])
def test_moe_files_of_other_architectures_are_refused(tmp_path, arch):
    """DeepSeek-V2's, which transformers' reader does not read, and gpt-oss's, which it reads but kvforge does not
    serve: one line naming the way out."""
    writer = GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    writer.add_block_count(1)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_token_list([f"t{i}" for i in range(32)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for native in (True, False):
        with pytest.raises(ValueError, match=rf"architecture '{arch}'.*not supported yet.*safetensors"):
            resolve_model(str(tmp_path / f"{arch}.gguf"), native_gguf=native)
