"""Mixture-of-experts GGUF files in llama.cpp's layout (core/gguf_moe.py): tiny Qwen2-MoE (shared expert) and
Qwen3-MoE models written as GGUF (tests/helpers/moe_gguf.py) give HF transformers' greedy tokens (fp32) served in
place, each expert's slice of the stacked tensors a view of the file, and converted dense (--gguf-dense); Qwen2-MoE
with F32 experts, Qwen3-MoE with Q8_0 ones (HF then runs on the dequantized weights). Mixtral's and OLMoE's files, which
transformers' GGUF reader does not read, are refused with one line."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from kvforge.core import LLM, SamplingParams
from kvforge.core.loader import resolve_model
from tests.helpers.moe_gguf import write_moe_gguf
from tests.helpers.parity import compare, hf_greedy
from tests.helpers.tiny_models import random_prompts, save_tiny_model, tiny_configs

NEW_TOKENS = 16
T = GGMLQuantizationType
# each family once (a file is indexed and converted in seconds: its 49152-token vocabulary): F32 experts (the file's
# values are HF's own) and Q8_0 ones
CASES = {"qwen2_moe-f32": ("qwen2_moe", T.F32), "qwen3_moe-q8_0": ("qwen3_moe", T.Q8_0)}


@pytest.fixture(scope="module", params=list(CASES))
def moe_file(request, tmp_path_factory, embedded_path):
    """(case, GGUF path, expert type, prompts, HF's greedy tokens and logits on the file's weights)."""
    family, experts = CASES[request.param]
    config = tiny_configs()[family]
    config.mlp_only_layers = []  # llama.cpp's qwen2moe has experts in every layer
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(family, path / "hf", embedded_path, seed=1234, config=config)
    gguf = write_moe_gguf(model, path / f"{request.param}.gguf", experts)
    prompts = random_prompts((1, 5, 17, 40), seed=7)
    return request.param, gguf, experts, prompts, hf_greedy(model, prompts, NEW_TOKENS, pad_id=0, eos_ids={2})


@pytest.mark.parametrize("dense", [False, True], ids=["in_place", "gguf_dense"])
def test_greedy_tokens_match_hf(moe_file, dense):
    name, gguf, experts, prompts, reference = moe_file
    # in place: x meets the experts' blocks in fp32 (the int16 activations are a separate, approximate choice)
    options = {} if dense else {"quant_options": {"activations": "fp32"}}
    llm = LLM(str(gguf), progress=False, dtype="float32", num_kv_blocks=128, gguf_dense=dense, **options)
    try:
        model = llm.engine.runner.model
        block = model.model.layers[0].mlp
        assert len(block.experts) == 8 and block.experts[0].down_proj.in_features == 32
        assert (block.shared_expert is not None) == name.startswith("qwen2_moe")
        if not dense:  # every expert's gate/up and down: its own slice of the one mapping of the file
            layers = [m for e in block.experts for m in (e.gate_up_proj, e.down_proj)]
            assert {q for m in layers for q, _ in m.segments.parts} == {int(experts)}
            views = [b for m in layers for _, b in m.segments.parts]
            assert len({b.data_ptr() for b in views}) == len(views) == 3 * 8
            assert {b.untyped_storage().nbytes() for b in views} == {gguf.stat().st_size}
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
        report = compare([o.token_ids for o in outs], *reference)
        print(name, "dense" if dense else "in place", report)
        assert report.exact >= len(prompts) - 1, report
    finally:
        llm.engine.close()


@pytest.mark.parametrize("arch", ["llama", "olmoe"])
def test_moe_files_transformers_cannot_read_are_refused(tmp_path, arch):
    """Mixtral (llama with experts) would read as a dense Llama, OLMoE not at all: one line naming the way out."""
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
