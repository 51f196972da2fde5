"""The quant method chosen per layer (core/quant_config.py): the LM head and the modules named in
`modules_to_not_convert` (the user's quant option, or a checkpoint's quantization_config) stay dense,
every other linear gets the engine's method; names match as in transformers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kvforge.app.quantize.rtn_writer import write_rtn_checkpoint
from kvforge.core import LLM, SamplingParams
from kvforge.core.estimate import estimate_memory
from kvforge.core.layers.linear import LinearBase
from kvforge.core.loader import load_config
from kvforge.core.models.llama import LlamaForCausalLM
from kvforge.core.plugins import DENSE_MODULES_OPTION
from kvforge.core.quant_config import QuantConfig, module_matches
from kvforge.plugins.quant.bnb_int8 import BnbInt8Method
from kvforge.plugins.quant.dense import DenseMethod
from kvforge.plugins.quant.gptq import GptqMethod
from tests.helpers.tiny_models import random_prompts, save_tiny_model


def _config(dense: tuple[str, ...] = ()) -> QuantConfig:
    options = BnbInt8Method.validate_options({DENSE_MODULES_OPTION: list(dense)} if dense else {})
    config = QuantConfig.for_checkpoint(BnbInt8Method, options, None)
    return config.with_packed_modules(LlamaForCausalLM.packed_modules_mapping)


def _methods(llm) -> dict[str, type]:
    return {name: type(m.quant_method) for name, m in llm.engine.runner.model.named_modules()
            if isinstance(m, LinearBase)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_path):
    path = tmp_path_factory.mktemp("tiny-llama3")
    model = save_tiny_model("llama3", path, embedded_path, seed=11)
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_names_match_as_in_transformers():
    assert module_matches("model.layers.1.mlp.down_proj", ["model.layers.1"])
    assert not module_matches("model.layers.11.mlp.down_proj", ["model.layers.1"])  # a module boundary
    assert module_matches("model.layers.11.mlp.down_proj", [r"model\.layers\.1\d"])  # a regex
    assert module_matches("model.layers.3.mlp.down_proj", ["down_proj"])  # a suffix
    assert not module_matches("model.layers.3.mlp.gate_proj", ["mlp.gate"])
    with pytest.raises(ValueError, match="not a valid module pattern"):
        module_matches("lm_head", ["model.layers.("])


def test_by_default_only_the_head_stays_dense():
    config = _config()
    assert isinstance(config.method_for("lm_head"), DenseMethod)
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                 "model.layers.5.mlp.gate_up_proj", "model.layers.5.mlp.down_proj"):
        assert isinstance(config.method_for(name), BnbInt8Method), name


def test_a_fused_layer_is_dense_when_all_its_projections_are_named():
    config = _config(("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                      "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.gate_up_proj"))
    assert isinstance(config.method_for("model.layers.0.self_attn.qkv_proj"), DenseMethod)
    assert isinstance(config.method_for("model.layers.1.mlp.gate_up_proj"), DenseMethod)  # kvforge's name
    assert isinstance(config.method_for("model.layers.0.self_attn.o_proj"), BnbInt8Method)
    with pytest.raises(ValueError, match="fuses .*gate_proj.*up_proj.* name all of them or none"):
        _config(("model.layers.2.mlp.up_proj",)).method_for("model.layers.2.mlp.gate_up_proj")


def test_the_option_is_checked_and_kept_out_of_the_methods_options():
    options = BnbInt8Method.validate_options({DENSE_MODULES_OPTION: ["model.layers.0"]})
    assert options[DENSE_MODULES_OPTION] == ["model.layers.0"]
    assert DENSE_MODULES_OPTION not in BnbInt8Method.validate_options({})  # absent unless given
    assert DENSE_MODULES_OPTION not in QuantConfig.for_checkpoint(BnbInt8Method, options, None).options
    with pytest.raises(ValueError, match="must be a list of module names"):
        BnbInt8Method.validate_options({DENSE_MODULES_OPTION: "model.layers.0"})
    with pytest.raises(ValueError, match="has no option 'skip'"):
        BnbInt8Method.validate_options({"skip": ["lm_head"]})


def test_layers_named_by_the_user_stay_dense_at_load(tiny):
    path, hf = tiny
    llm = LLM(str(path), quant="bnb-int8", quant_options={DENSE_MODULES_OPTION: ["model.layers.0.mlp"]},
              progress=False, num_kv_blocks=64, dtype="float32")  # the dense layers compared with fp32 F.linear
    methods = _methods(llm)
    dense = {name for name, cls in methods.items() if cls is DenseMethod}
    assert dense == {"lm_head", "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"}
    assert all(cls is BnbInt8Method for name, cls in methods.items() if name not in dense)
    assert all(m.prefix == name for name, m in llm.engine.runner.model.named_modules() if isinstance(m, LinearBase))

    layer0, layer1 = llm.engine.runner.model.model.layers[:2]
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.allclose(layer0.mlp.down_proj(x), F.linear(x, hf["model.layers.0.mlp.down_proj.weight"]),
                              rtol=1e-5, atol=1e-5)  # dense fp32 (oneDNN's rounding)
        quantized = layer1.mlp.down_proj(x)
    want = F.linear(x, hf["model.layers.1.mlp.down_proj.weight"])
    assert 0 < float((quantized - want).norm() / want.norm()) < 0.02  # int8, yet close
    outs = llm.generate(random_prompts((3, 9), seed=2), SamplingParams(temperature=0, max_tokens=6))
    assert all(1 <= len(out.token_ids) <= 6 for out in outs)


def test_a_checkpoints_modules_to_not_convert_load_dense(tiny, tmp_path):
    """A GPTQ checkpoint that stores some layers unquantized (recorded in its quantization_config, as
    GPTQModel and transformers write it) loads them dense and the others through the gptq method."""
    path, hf = tiny
    out = write_rtn_checkpoint(path, tmp_path / "gptq", method="gptq", group_size=64,
                               modules_to_not_convert=["model.layers.1.self_attn"])
    quantization_config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quantization_config["modules_to_not_convert"] == ["model.layers.1.self_attn"]

    llm = LLM(str(out), progress=False, num_kv_blocks=64, dtype="float32")
    assert llm.engine.config.quant == "gptq"
    methods = _methods(llm)
    dense = {name for name, cls in methods.items() if cls is DenseMethod}
    assert dense == {"lm_head", "model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj"}
    assert all(cls is GptqMethod for name, cls in methods.items() if name not in dense)

    attention = llm.engine.runner.model.model.layers[1].self_attn
    w = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert torch.allclose(attention.qkv_proj(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    outs = llm.generate(random_prompts((5,), seed=3), SamplingParams(temperature=0, max_tokens=6))
    assert 1 <= len(outs[0].token_ids) <= 6


def test_the_memory_estimate_counts_layers_kept_dense_at_the_dtypes_size(embedded_path):
    """The estimate before loading (the settings panel's) asks the same QuantConfig as loading: a layer kept
    dense takes the dtype's bytes per weight, not the method's."""
    hf_config = load_config(embedded_path)
    int8 = BnbInt8Method.bits_per_weight({}) / 8
    all_int8 = estimate_memory(hf_config, "float32", 0, _config())["weights_bytes"]
    mlp_0_dense = estimate_memory(hf_config, "float32", 0, _config(("model.layers.0.mlp",)))["weights_bytes"]
    assert mlp_0_dense - all_int8 == pytest.approx(3 * 576 * 1536 * (4 - int8), abs=2)
    all_dense = _config((r"model\.layers\.\d+",))
    assert estimate_memory(hf_config, "float32", 0, all_dense) == estimate_memory(hf_config, "float32", 0)
    tp2 = estimate_memory(hf_config, "float32", 0, _config(("model.layers.0.mlp",)), tp_size=2)
    assert tp2["rank_weights_bytes"] - estimate_memory(hf_config, "float32", 0, _config(), tp_size=2)[
        "rank_weights_bytes"] == pytest.approx(3 * 576 * 768 * (4 - int8), abs=2)  # half the MLP on rank 0


def test_the_memory_estimate_predicts_a_model_with_dense_layers(embedded_path):
    """bnb-int8 with every MLP kept dense (fp32): the estimate is within 5% of what loading measured (it was
    a third too low while the dense MLPs were counted at 8 bits)."""
    options = {DENSE_MODULES_OPTION: [r"model\.layers\.\d+\.mlp"]}
    llm = LLM(str(embedded_path), quant="bnb-int8", quant_options=options, progress=False, num_kv_blocks=16)
    try:
        config = llm.engine.config
        quant = QuantConfig.for_checkpoint(BnbInt8Method, config.quant_options, None)
        estimate = estimate_memory(llm.engine.hf_config, config.dtype, 0, quant)["weights_bytes"]
        measured = llm.engine.runtime().weight_bytes
        assert abs(estimate / measured - 1) < 0.05, (estimate, measured)
    finally:
        llm.engine.close()
