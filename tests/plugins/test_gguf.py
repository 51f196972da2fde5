"""The `gguf` quant method: GGUF block types decoded losslessly (against the `gguf` package's own dequantizer),
each kernel's matmul against x @ dequantize(W), and the embedded model served from its Q4_1 blocks read in place:
with the dense kernel in fp32 the same tokens as the dense conversion, with the blocks kernels (the default) close
to fp32 by the top-5 rule with the perplexity within +3%."""

from __future__ import annotations

from importlib.resources import files

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvforge.core import LLM
from kvforge.core.config import resolve_dtype
from kvforge.core.layers.linear import ReplicatedLinear
from kvforge.core.loader import embedded_gguf_path
from kvforge.core.model_files import read_gguf_header
from kvforge.core.perplexity import perplexity
from kvforge.core.sampling import SamplingParams
from kvforge.plugins.quant.cpu_kernels import int4pack_available
from kvforge.plugins.quant.gguf import GgufMethod
from kvforge.plugins.quant.gguf_blocks import DECODERS, FOUR_BIT, decode
from tests.helpers.gguf_layers import blocks_tensor, gguf_layer, random_blocks
from tests.helpers.optional_parts import require
from tests.helpers.parity import logprobs_close

T = GGMLQuantizationType
@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda t: t.name)
def test_decoding_reproduces_gguf_dequantize_bit_for_bit(qtype):
    raw = random_blocks(qtype, 8, 512)
    assert torch.equal(decode(raw, qtype).dequantize(), torch.from_numpy(dequantize(raw, qtype)))


def test_decoding_real_files_tensors(gemma_gguf_path):
    """The first tensor of every quantized type in the embedded Q4_1 file and Gemma 3's Q4_K_M file (its first 64
    rows, located by the header reader: GGUFReader walks Gemma's 262k-token vocabulary into numpy for ~20 s)."""
    seen = set()
    for path in (embedded_gguf_path(), gemma_gguf_path):
        header = read_gguf_header(path)
        for tensor in header.tensors:
            qtype = T(tensor.ggml_type)
            if qtype in DECODERS and qtype not in seen:
                seen.add(qtype)
                block, type_size = GGML_QUANT_SIZES[qtype]
                row_bytes = tensor.shape[0] // block * type_size
                n_rows = min(64, tensor.n_bytes // row_bytes)
                rows = np.fromfile(path, np.uint8, n_rows * row_bytes, offset=header.data_offset + tensor.offset)
                rows = rows.reshape(n_rows, row_bytes)
                assert torch.equal(decode(rows, qtype).dequantize(), torch.from_numpy(dequantize(rows, qtype))), \
                    tensor.name
    assert {T.Q4_1, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K} <= seen


def test_an_unsupported_type_is_named_with_the_way_out():
    with pytest.raises(ValueError, match="IQ2_XXS is not supported natively.*--gguf-dense"):
        decode(np.zeros((1, 66), dtype=np.uint8), T.IQ2_XXS)


@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda t: t.name)
def test_dense_kernel_is_exact_in_fp32(qtype):
    layer, weight = gguf_layer(qtype, torch.float32, "dense")
    assert torch.equal(layer.weight, weight)
    x = torch.randn(3, weight.shape[1])
    assert torch.equal(layer(x), torch.nn.functional.linear(x, weight))


@pytest.mark.skipif(not int4pack_available(), reason="torch has no CPU int4 kernel")
@pytest.mark.parametrize("qtype", FOUR_BIT, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4pack_kernel_matches_the_dequantized_weight(qtype, rows):
    """bf16 compute with bf16 scales and zeros: within bf16 rounding of x @ W.T (fp32 reference)."""
    layer, weight = gguf_layer(qtype, torch.bfloat16, "int4pack")
    assert layer.int4 is not None
    x = torch.randn(rows, weight.shape[1])
    expected = x @ weight.T
    got = layer(x.to(torch.bfloat16)).float()
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 2e-2 * scale, ((got - expected).abs().max(), scale)


def _c_kernels():
    from kvforge.core.cpu_kernels import unavailable

    require(unavailable() is None, f"the C kernels do not build here: {unavailable()}")


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1, T.Q6_K, T.Q8_0, T.Q5_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_wider_codes_take_the_int8_kernel(qtype, rows):
    """Codes wider than 4 bits: int4pack refuses them by name; int8 runs them from their int8 codes (groups of 32
    kept at 32, offsets only where the type has them) in fp32 math, within bf16 output rounding of x @ W.T; from
    `wide_rows` rows the weight is expanded to bf16 (exactly bf16(W)) for the bf16 GEMM; it refuses fp32 models."""
    from kvforge.core.cpu_kernels import dequant_int8

    _c_kernels()
    with pytest.raises(ValueError, match="cannot use the int4pack kernel: its codes are wider than 4 bits"):
        gguf_layer(qtype, torch.bfloat16, "int4pack")
    layer, weight = gguf_layer(qtype, torch.bfloat16, "int8")
    codes, scales, offsets = layer.int8
    assert layer.int4 is None and layer.weight is None
    assert scales.shape[1] == weight.shape[1] // (32 if qtype in (T.Q5_0, T.Q5_1, T.Q8_0, T.Q5_K) else 16)
    assert (offsets is None) == (qtype in (T.Q5_0, T.Q6_K, T.Q8_0))
    assert torch.equal(dequant_int8(*layer.int8), weight.to(torch.bfloat16))
    x = torch.randn(rows, weight.shape[1]).to(torch.bfloat16)
    expected = x.double() @ weight.double().T
    layer.wide_rows = None  # the int8 kernel at every row count
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - expected).abs() <= 2 ** -8 * expected.abs() + 1e-6 * expected.abs().max()).all()
    layer.wide_rows = 1  # the expand-then-GEMM path
    assert torch.equal(layer(x), torch.nn.functional.linear(x, weight.to(torch.bfloat16)))
    with pytest.raises(ValueError, match="cannot use the int8 kernel: it computes in bf16"):
        gguf_layer(qtype, torch.float32, "int8")


def test_auto_activations_follow_this_cpus_timing(tmp_path, monkeypatch):
    """`activations: auto` quantizes x to int16 up to the row count the timing found faster (kept in the
    kernel-choice cache like wide_rows), fp32 beyond: a layer's output is the int16 kernel's bits up to it and the
    fp32 kernel's past it; a cached answer is read, not re-timed."""
    from kvforge.core import kernel_choice
    from kvforge.core.cpu import cpu_signature
    from kvforge.core.cpu_kernels import gguf_linear
    from kvforge.plugins.quant.block_paths import INT16_TIMED_ROWS, int16_rows

    _c_kernels()
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    found = int16_rows.__wrapped__(threads)
    assert found in (0, *INT16_TIMED_ROWS)
    cache = kernel_choice.ChoiceCache(tmp_path, cpu_signature())
    (key, entry), = cache.read().items() or [(None, None)]
    if entry is not None:  # a steady timing: kept, and the choice is the one it shows
        us = entry["us"]
        assert found == next((r for r in reversed(INT16_TIMED_ROWS)
                              if all(us["int16"][str(n)] < us["fp32"][str(n)] for n in INT16_TIMED_ROWS if n <= r)), 0)
        cache.write({key: {**entry, "choice": 3}})  # what an earlier process found
        assert int16_rows.__wrapped__(threads) == 3
    layer, _ = gguf_layer(T.Q4_K, torch.float32, "blocks", rows=64, cols=256)
    layer.int16_rows = 3
    for rows in (1, 3, 4):
        x = torch.randn(rows, 256)
        expected = gguf_linear(x, layer.segments, activations="int16" if rows <= 3 else "fp32")
        assert torch.equal(layer.quant_method.apply(layer, x), expected)


def test_wide_rows_timing_is_kept_for_the_next_load(tmp_path, monkeypatch):
    """A steady timing of where expanding beats a kernel goes to the kernel-choice cache of this CPU signature; a
    later process reads it there instead of timing again (an unsteady one is not kept)."""
    from kvforge.core import kernel_choice
    from kvforge.core.cpu import cpu_signature
    from kvforge.plugins.quant.block_paths import wide_rows

    _c_kernels()
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    real_time_calls, timed = kernel_choice.time_calls, []

    def time_calls(*args, steady: bool, **kwargs):
        timed.append(real_time_calls(*args, **kwargs))
        return kernel_choice.Timing(timed[-1].us, steady)

    threads = torch.get_num_threads()
    cache = kernel_choice.ChoiceCache(tmp_path, cpu_signature())
    monkeypatch.setattr(kernel_choice, "time_calls", lambda *a, **k: time_calls(*a, steady=False, **k))
    wide_rows.__wrapped__("int8", 64, 256, threads)  # __wrapped__: past the per-process memo
    assert len(timed) == 1 and cache.read() == {}
    monkeypatch.setattr(kernel_choice, "time_calls", lambda *a, **k: time_calls(*a, steady=True, **k))
    first = wide_rows.__wrapped__("int8", 64, 256, threads)
    (key, entry), = cache.read().items()
    assert len(timed) == 2 and entry == {"choice": first, "us": {k: {str(n): t for n, t in v.items()}
                                                                 for k, v in timed[-1].us.items()}}
    cache.write({key: {**entry, "choice": 64}})  # what an earlier process found
    assert wide_rows.__wrapped__("int8", 64, 256, threads) == 64 and len(timed) == 2  # read, not timed
    wide_rows.__wrapped__("int4pack", 64, 256, threads)
    assert len(timed) == 3  # another kind, another entry


def test_int8_kernel_rows_do_not_depend_on_the_batch():
    """A row's result is the same alone or among others (the kernel's blocks of rows and outputs, and a tail of
    outputs past them): bit for bit."""
    from kvforge.core.cpu_kernels import int8_linear

    _c_kernels()
    torch.manual_seed(0)
    codes = torch.randint(-128, 128, (70, 96), dtype=torch.int8)
    scales, offsets = torch.rand(70, 6), torch.randn(70, 6)
    x = torch.randn(11, 96).to(torch.bfloat16)
    together = int8_linear(x, codes, scales, offsets)
    alone = torch.cat([int8_linear(x[i:i + 1], codes, scales, offsets) for i in range(11)])
    assert torch.equal(together, alone)
    w = codes.double() * scales.double().repeat_interleave(16, 1) + offsets.double().repeat_interleave(16, 1)
    assert torch.allclose(int8_linear(x.float(), codes, scales, offsets).double(), x.double() @ w.T, rtol=1e-5,
                          atol=1e-4)


def test_fused_projections_of_different_types_share_one_layer():
    """Q4_K_M files mix types inside a fused layer (e.g. Q4_K, Q6_K): each part keeps its own blocks, read in place
    by the blocks kernel; decoded, the fused layer holds each part's exact weight."""
    from kvforge.core.layers.linear import MergedColumnParallelLinear

    raws = [(random_blocks(t, 32, 256, seed=i), t) for i, t in enumerate((T.Q4_K, T.Q6_K))]
    weight = torch.cat([torch.from_numpy(dequantize(r, t)) for r, t in raws])
    layers = {}
    for kernel in ("blocks", "dense"):
        layer = MergedColumnParallelLinear(256, [32, 32], quant_method=GgufMethod(kernel=kernel),
                                           params_dtype=torch.float32)
        for shard, (raw, qtype) in enumerate(raws):
            layer.qblocks.weight_loader(layer.qblocks, blocks_tensor(raw, qtype, 256), shard)
        layer.process_after_loading()
        layers[kernel] = layer
    assert torch.equal(layers["dense"].weight, weight)
    blocks = layers["blocks"]
    assert [b.data_ptr() for _, b in blocks.segments.parts] == [torch.from_numpy(r).data_ptr() for r, _ in raws]
    x = torch.randn(3, 256)
    assert torch.allclose(blocks(x), x @ weight.T, rtol=0.05, atol=0.05 * (x @ weight.T).abs().max().item())


def test_permuted_rows_are_reordered_on_the_output():
    """Llama's Q / K rows lie permuted in GGUF files: the blocks path reorders its output columns, the decoding paths
    their rows; both give the HF-ordered projection."""
    raw = random_blocks(T.Q4_0, 64, 256, seed=3)
    order = torch.randperm(64)
    weight = torch.from_numpy(dequantize(raw, T.Q4_0))[order]
    x = torch.randn(2, 256)
    outputs = {}
    for kernel in ("blocks", "dense"):
        layer = ReplicatedLinear(256, 64, quant_method=GgufMethod(kernel=kernel), params_dtype=torch.float32)
        blocks = blocks_tensor(raw, T.Q4_0, 256)
        blocks.gguf_rows = order
        layer.qblocks.weight_loader(layer.qblocks, blocks)
        layer.process_after_loading()
        outputs[kernel] = layer(x)
    assert torch.equal(outputs["dense"], torch.nn.functional.linear(x, weight))
    scale = outputs["dense"].abs().max().item()
    assert torch.allclose(outputs["blocks"], outputs["dense"], rtol=0.05, atol=0.05 * scale)


PROMPTS = ["What is machine learning?", "Who painted the Mona Lisa?", "What is the capital of Japan?",
           "Explain in two sentences why the sky is blue.", "Write a Python function that returns the square of a "
           "number."]


def _run(llm: LLM, top: int = 5):
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, logprobs=top))
    text = files("kvforge.app.bench").joinpath("eval_text.txt").read_text()
    return ([o.token_ids for o in outs], [[{t for t, _ in lp.top} for lp in o.logprobs] for o in outs],
            perplexity(llm.engine, llm.tokenizer.encode(text)))


def test_the_embedded_model_from_its_q4_1_blocks(embedded_llm):
    """The default: the embedded GGUF is served from its own blocks, read in place from the memory-mapped file. With
    the dense kernel, fp32 gives the dense conversion's tokens exactly (the weights are bit for bit transformers'
    dequantization); the default (blocks kernels, fp32 activations) is close to fp32 by the top-5 rule on
    every prompt with the perplexity within +3%, in fp32 and in the default dtype, every projection and the head
    reading the one mapping of the file, and holding under a fifth of the dense fp32 weights' bytes."""
    dense32 = LLM(progress=False, dtype="float32", kv_cache_bytes=64 << 20, quant_options={"kernel": "dense"})
    assert dense32.engine.config.quant == "gguf"
    prompts = [dense32.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    assert [o.token_ids for o in dense32.generate(prompts, greedy)] == \
        [o.token_ids for o in embedded_llm.generate(prompts, greedy)]
    del dense32

    reference = _run(embedded_llm)
    dense_bytes = embedded_llm.engine.runtime().weight_bytes
    for dtype in dict.fromkeys(["float32", resolve_dtype("auto")]):
        native = LLM(progress=False, dtype=dtype, kv_cache_bytes=64 << 20)
        layers = [m for m in native.engine.runner.model.modules() if getattr(m, "segments", None) is not None]
        storages = {blocks.untyped_storage().data_ptr() for m in layers for _, blocks in m.segments.parts}
        assert len(layers) == 30 * 4 + 1 and len(storages) == 1  # q/k/v, o, gate/up, down per layer; the head
        assert next(iter(storages)) == layers[0].segments.parts[0][1].untyped_storage().data_ptr()
        ids, tops, ppl = _run(native)
        native_bytes = native.engine.runtime().weight_bytes
        print(f"\ngguf blocks ({dtype}): perplexity {ppl:.3f} vs dense fp32 {reference[2]:.3f}; "
              f"weights {native_bytes / 2**20:.1f} MiB vs {dense_bytes / 2**20:.1f} MiB")
        diverged = [why for i in range(len(PROMPTS))
                    if (why := logprobs_close(ids[i], tops[i], reference[0][i], reference[1][i], f"prompt {i}"))]
        assert not diverged, diverged
        assert ppl / reference[2] <= 1.03
        assert native_bytes <= dense_bytes / 5
        del native


@pytest.mark.skipif(not int4pack_available(), reason="torch has no CPU int4 kernel")
def test_the_wide_path_expands_the_int4_weight_exactly():
    """From `wide_rows` rows a 4-bit layer expands its weight to bf16 (core/cpu_kernels/dequant.c) and runs the
    bf16 GEMM: the expanded weight is bf16((q - 8) * scale + zero) of the int4 kernel's own scales and zeros,
    and the layer's output stays within the int4 kernel's tolerance."""
    from kvforge.core.cpu_kernels import dequant_int4, pack_nibbles, unavailable
    from kvforge.plugins.quant.block_paths import expanded_linear

    if unavailable() is not None:
        pytest.skip(f"the C kernels do not build here: {unavailable()}")
    layer, weight = gguf_layer(T.Q4_K, torch.bfloat16, "int4pack", rows=96, cols=512)
    sz = layer.int4.scales_and_zeros.float()  # [K / 32, N, 2]
    codes = decode(random_blocks(T.Q4_K, 96, 512, seed=1), T.Q4_K).codes
    expected = ((codes.float() - 8) * sz[:, :, 0].T.repeat_interleave(32, 1)
                + sz[:, :, 1].T.repeat_interleave(32, 1)).to(torch.bfloat16)
    assert torch.equal(dequant_int4(pack_nibbles(codes), layer.int4.scales_and_zeros), expected)
    x = torch.randn(40, 512)
    wide = expanded_linear(x, dequant_int4(pack_nibbles(codes), layer.int4.scales_and_zeros))
    assert torch.equal(wide, torch.nn.functional.linear(x.to(torch.bfloat16), expected).float())
    reference = x @ weight.T
    assert (wide - reference).abs().max() <= 2e-2 * reference.abs().max()
    layer.nibbles, layer.wide_rows = pack_nibbles(codes), 16  # the layer takes the path from 16 rows
    assert torch.equal(layer(x), wide)
