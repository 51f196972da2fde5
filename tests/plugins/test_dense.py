"""The built-in dense method: its two CPU kernels (oneDNN's prepacked linear, a private torch op, against
F.linear), offered to the kernel choice and switched by it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.core.kernel_choice import choose_kernels
from kvforge.core.layers.linear import ReplicatedLinear
from kvforge.plugins.quant.dense import onednn_packing_available

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _layer(dtype: torch.dtype, bias: bool, kernel: str | None) -> tuple[ReplicatedLinear, torch.Tensor]:
    layer = ReplicatedLinear(96, 80, bias=bias, params_dtype=dtype)
    weight = torch.randn(80, 96, dtype=dtype)
    layer.weight_loader(layer.weight, weight)
    if bias:
        layer.weight_loader(layer.bias, torch.randn(80, dtype=dtype))
    layer.process_after_loading()
    if kernel is not None:
        layer.quant_method.use_kernel(layer, kernel)
    return layer, weight


def require_onednn(dtype: torch.dtype) -> None:
    if not onednn_packing_available(torch.empty(1, dtype=dtype)):
        pytest.skip(f"no oneDNN prepacked linear for {dtype} here (the torch build has none, or the CPU cannot run "
                    "oneDNN's bf16, e.g. AVX2 only); F.linear is the only kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias):
    require_onednn(dtype)
    layer, weight = _layer(dtype, bias, "onednn")
    assert layer.packed_weight is not None and layer.weight is None
    x = torch.randn(rows, 2 * 96, dtype=dtype)[:, ::2]  # a non-contiguous input
    reference = F.linear(x.float(), weight.float(), None if layer.bias is None else layer.bias.float())
    out = layer(x)
    assert out.shape == (rows, 80) and out.dtype == dtype
    error = (out.float() - reference).abs().max() / reference.abs().max()
    assert error < TOLERANCE[dtype], error
    assert layer.quant_method.weight_bytes(layer) == weight.numel() * weight.element_size()


def test_torch_kernel_is_f_linear_exactly():
    layer, weight = _layer(torch.float32, True, "torch")
    assert layer.packed_weight is None
    x = torch.randn(5, 96)
    assert torch.equal(layer(x), F.linear(x, weight, layer.bias))


def test_both_kernels_are_offered_on_cpu_in_fp32_and_bf16_only():
    for dtype in (torch.float32, torch.bfloat16):
        require_onednn(dtype)
        layer, _ = _layer(dtype, False, None)
        assert list(layer.quant_method.kernels(layer)) == ["torch", "onednn"]  # the stock kernel first
    layer, weight = _layer(torch.float16, False, None)
    assert layer.quant_method.kernels(layer) == {}  # fp16: nothing to choose
    x = torch.randn(3, 96, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, weight))


def test_forced_choice_switches_every_layer_of_a_model(tmp_path):
    require_onednn(torch.float32)
    model = torch.nn.Sequential(*(_layer(torch.float32, False, None)[0] for _ in range(3)))
    x = torch.randn(4, 96)
    with torch.inference_mode():
        first = model[0](x)
    choices = choose_kernels(model, torch.float32, linear="onednn", cache_dir=tmp_path)
    assert [(c.key, c.layers, c.choice) for c in choices] == [("DenseMethod:float32:80x96", 3, "onednn")]
    assert all(layer.packed_weight is not None for layer in model)
    with torch.inference_mode():
        assert torch.allclose(model[0](x), first, atol=1e-5)
    assert not (tmp_path / "kernel_choice").exists()  # a forced choice times nothing and caches nothing


@pytest.fixture(scope="module")
def narrow_checkpoints(tmp_path_factory, embedded_path):
    """The tiny Llama saved as bf16 and as fp16 safetensors (the dtypes checkpoints ship in)."""
    import copy

    from tests.helpers.tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("narrow")
    reference = save_tiny_model("llama3", root / "fp32", embedded_path, seed=5)
    paths = {}
    for dtype in (torch.bfloat16, torch.float16):
        save_tiny_model("llama3", root / str(dtype), embedded_path, seed=5)  # tokenizer files and config
        copy.deepcopy(reference).to(dtype).save_pretrained(root / str(dtype))
        paths[dtype] = root / str(dtype)
    return paths


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_narrow_checkpoint_in_an_fp32_model_keeps_its_weights(narrow_checkpoints, dtype):
    """A bf16 / fp16 checkpoint served in fp32 on CPU (`dtype auto` where the CPU has no native bf16): the projections
    and the head stay in the checkpoint's dtype (half the bytes) and compute through the C kernel, fp32 math on the
    exactly widened weights; `weights: model` converts them at load (torch's matmul). The two differ only in their
    sums' order: the same greedy tokens where no near-tie, logprobs within fp32 rounding."""
    from kvforge.core import LLM, SamplingParams
    from tests.helpers.parity import logprobs_close
    from tests.helpers.tiny_models import random_prompts

    path = str(narrow_checkpoints[dtype])
    kept = LLM(path, dtype="float32", progress=False, kv_cache_bytes=16 << 20)
    widened = LLM(path, dtype="float32", progress=False, kv_cache_bytes=16 << 20, quant_options={"weights": "model"})
    layers = {name: [m for m in llm.engine.runner.model.modules() if hasattr(m, "quant_method")]
              for name, llm in (("kept", kept), ("widened", widened))}
    assert {m.weight.dtype for m in layers["kept"]} == {dtype}
    assert all(m.float_segments is not None for m in layers["kept"])
    # (a widened layer's weight may be oneDNN's packed copy, where the kernel choice took that kernel)
    assert {(m.weight if m.weight is not None else m.packed_weight).dtype for m in layers["widened"]} == {torch.float32}
    assert 2 * sum(m.weight_bytes for m in layers["kept"]) == sum(m.weight_bytes for m in layers["widened"])
    # the estimate before loading (kvforge models, the UI) counts what each keeps
    from kvforge.core.estimate import estimate_memory
    from kvforge.core.quant_config import QuantConfig
    from kvforge.plugins.quant.dense import DenseMethod

    for llm, options in ((kept, {}), (widened, {"weights": "model"})):
        quant = QuantConfig.for_checkpoint(DenseMethod, DenseMethod.validate_options(options), None)
        estimate = estimate_memory(llm.engine.hf_config, "float32", 0, quant)["weights_bytes"]
        assert abs(estimate / llm.engine.runtime().weight_bytes - 1) < 0.02, (options, estimate)

    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    prompts = random_prompts((9, 33, 70), seed=6)
    outs, references = kept.generate(prompts, params), widened.generate(prompts, params)

    def top(out) -> list[set[int]]:
        return [{t for t, _ in lp.top} for lp in out.logprobs]

    assert not [f for f in (logprobs_close(o.token_ids, top(o), r.token_ids, top(r), str(i))
                            for i, (o, r) in enumerate(zip(outs, references))) if f]
    for o, r in zip(outs, references):
        same = next((i for i, (a, b) in enumerate(zip(o.token_ids, r.token_ids)) if a != b), len(o.token_ids))
        for a, b in zip(o.logprobs[:same], r.logprobs[:same]):
            assert abs(a.logprob - b.logprob) < 1e-4
    assert sum(o.token_ids == r.token_ids for o, r in zip(outs, references)) >= 2


def test_shards_of_different_dtypes_widen_the_parameter_exactly():
    """A fused layer whose checkpoint projections come in different dtypes (bf16 gate, fp32 up): the parameter
    returns to fp32, the bf16 shard widened exactly (the loader calls choose_dtype before each copy)."""
    from kvforge.core.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(32, [16, 16], params_dtype=torch.float32)
    gate, up = torch.randn(16, 32).bfloat16(), torch.randn(16, 32)
    for shard, tensor in enumerate((gate, up)):
        layer.weight.choose_dtype(tensor.dtype)
        layer.weight_loader(layer.weight, tensor.to(layer.weight.dtype), shard)
    layer.process_after_loading()
    assert layer.weight.dtype == torch.float32 and layer.float_segments is None
    assert torch.equal(layer.weight, torch.cat([gate.float(), up]))
