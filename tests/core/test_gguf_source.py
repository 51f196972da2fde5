"""A GGUF served in place (core/gguf_source.py): indexed once into a small directory with no weights, every block-type
tensor a view of one memory mapping of the file (projections of mixed types, an untied head, a quantized embedding),
the model close to the same file dequantized; a tensor type without a kernel named with the way out. Read from a
copy on huge pages or from the file's mapping (gguf_weights). On a llama-shaped file with llama.cpp's metadata and
Q4_K_M mix (app/bench/real_shapes.py's tiny shape), and on its mixture-of-experts shape (tiny-moe, architecture
olmoe: stacked experts served one expert at a time in place)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvforge.app.bench.real_shapes import shape_gguf
from kvforge.core import LLM, SamplingParams
from kvforge.core.gguf_source import COPY_SHARE, INDEX_FILE, copies_weights
from kvforge.core.loader import resolve_model
from kvforge.core.metrics import available_memory_bytes
from kvforge.core.model_files import read_gguf_header
from kvforge.core.perplexity import perplexity


@pytest.fixture(scope="module")
def files(tmp_path_factory, embedded_path):  # embedded_path: the tokenizer the shapes borrow
    root = tmp_path_factory.mktemp("shapes")
    return {quant: shape_gguf("tiny", quant, root=root) for quant in ("q4_k_m", "f16")}


def test_served_in_place_from_a_small_index(files):
    """Q4_K_M's mix: Q4_K projections with attn_v / ffn_down in Q6_K (fused q/k/v of two types), a Q6_K head, a Q4_K
    embedding."""
    gguf = files["q4_k_m"]
    index = resolve_model(str(gguf), native_gguf=True)
    stamp = (index / INDEX_FILE).stat().st_mtime_ns
    assert resolve_model(str(gguf), native_gguf=True) == index and (index / INDEX_FILE).stat().st_mtime_ns == stamp
    assert not list(index.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in index.iterdir()) < gguf.stat().st_size / 4

    llm = LLM(str(gguf), progress=False, dtype="float32", kv_cache_bytes=16 << 20, gguf_weights="mapped")
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if getattr(m, "segments", None) is not None]
    blocks = [b for m in layers for _, b in m.segments.parts]
    assert len(layers) == 2 * 4 + 1  # per layer q/k/v, o, gate/up, down; the untied head
    assert {b.untyped_storage().data_ptr() for b in blocks} == {blocks[0].untyped_storage().data_ptr()}
    assert blocks[0].untyped_storage().nbytes() == gguf.stat().st_size  # the whole file, mapped once
    types = {qtype for m in layers for qtype, _ in m.segments.parts}
    assert types == {12, 14}  # Q4_K and Q6_K
    assert {qtype for qtype, _ in layers[0].segments.parts} == {12, 14}  # q, k in Q4_K and v in Q6_K: one matmul
    assert model.model.embed_tokens.table_bytes == 0  # the quantized embedding's rows come from the file
    assert llm.engine.runtime().weight_bytes < gguf.stat().st_size

    ids = list(np.random.default_rng(0).integers(3, 40000, 200))
    dense = LLM(str(gguf), progress=False, dtype="float32", kv_cache_bytes=16 << 20, quant_options={"kernel": "dense"})
    assert dense.engine.runtime().weight_bytes > 4 * llm.engine.runtime().weight_bytes
    ours, reference = perplexity(llm.engine, ids), perplexity(dense.engine, ids)
    assert abs(ours / reference - 1) < 0.01, (ours, reference)


def test_float_weights_are_served_in_place_too(files):
    """An F16 file: every projection, the head and the embedding read from the mapping, in fp32 math: the same
    perplexity as the file's weights copied into dense fp32 layers, to fp32 rounding."""
    gguf = files["f16"]
    llm = LLM(str(gguf), progress=False, dtype="float32", kv_cache_bytes=16 << 20, gguf_weights="mapped")
    layers = [m for m in llm.engine.runner.model.modules() if getattr(m, "segments", None) is not None]
    assert len(layers) == 2 * 4 + 1 and {q for m in layers for q, _ in m.segments.parts} == {1}
    assert {b.untyped_storage().nbytes() for m in layers for _, b in m.segments.parts} == {gguf.stat().st_size}
    assert llm.engine.runner.model.model.embed_tokens.table_bytes == 0
    ids = list(np.random.default_rng(1).integers(3, 40000, 200))
    dense = LLM(str(gguf), progress=False, dtype="float32", kv_cache_bytes=16 << 20, quant_options={"kernel": "dense"})
    ours, reference = perplexity(llm.engine, ids), perplexity(dense.engine, ids)
    assert abs(ours / reference - 1) < 1e-4, (ours, reference)


def test_auto_copies_the_blocks_onto_huge_pages_and_mapped_serves_the_file(files, tmp_path):
    """gguf_weights: auto (the default; this machine's memory holds the file many times over) reads the file's tensor
    data once into anonymous memory, every block a view of that one copy; mapped serves the file's own pages. Told
    apart by what they read: the file's tensor data overwritten in place after both loaded, the copied engine's
    perplexity stays as it was and the mapped one's changes (a private mapping sees the file's unwritten pages)."""
    gguf = tmp_path / "model.gguf"
    shutil.copyfile(files["q4_k_m"], gguf)
    data_offset = read_gguf_header(gguf).data_offset
    ids = list(np.random.default_rng(2).integers(3, 40000, 64))
    engines, before = {}, {}
    for mode in ("auto", "mapped"):
        llm = LLM(str(gguf), progress=False, dtype="float32", kv_cache_bytes=16 << 20, gguf_weights=mode)
        layers = [m for m in llm.engine.runner.model.modules() if getattr(m, "segments", None) is not None]
        storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes()
                    for m in layers for _, b in m.segments.parts}
        assert list(storages.values()) == [gguf.stat().st_size - (data_offset if mode == "auto" else 0)]
        assert llm.engine.runtime().gguf_weights == ("copied" if mode == "auto" else "mapped")  # the model card's
        engines[mode], before[mode] = llm, perplexity(llm.engine, ids)
    assert before["auto"] == before["mapped"]  # the same bytes either way
    with open(gguf, "r+b") as f:  # every tensor's bytes zeroed, in place
        f.seek(data_offset)
        f.write(bytes(gguf.stat().st_size - data_offset))
    assert perplexity(engines["auto"].engine, ids) == before["auto"]
    assert perplexity(engines["mapped"].engine, ids) != before["mapped"]
    for llm in engines.values():
        llm.engine.close()


def test_auto_maps_what_a_copy_would_not_suit(tmp_path):
    """auto maps a file over 3/4 of the available memory (a sparse file that large), on a GPU, and in each process
    of a parallel engine; the explicit settings are followed."""
    huge = tmp_path / "huge.gguf"
    with open(huge, "wb") as f:
        f.truncate(int(available_memory_bytes() * COPY_SHARE) + (1 << 30))
    small = tmp_path / "small.gguf"
    small.write_bytes(bytes(4096))
    assert copies_weights("auto", small, "cpu", 1) and not copies_weights("auto", huge, "cpu", 1)
    assert not copies_weights("auto", small, "cuda", 1) and not copies_weights("auto", small, "cpu", 2)
    assert copies_weights("copied", huge, "cuda", 4) and not copies_weights("mapped", small, "cpu", 1)


def test_a_type_without_a_kernel_is_named(tmp_path, embedded_path):
    """A projection in IQ4_NL: one error naming the tensor, its type and --gguf-dense, before any weight is read."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    for key, value in (("block_count", 1), ("context_length", 128), ("embedding_length", 64),
                       ("feed_forward_length", 64), ("head_count", 4), ("head_count_kv", 4)):
        getattr(writer, f"add_{key}")(value)
    writer.add_token_list([f"t{i}" for i in range(64)])
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.normal(0, 0.02, (64, 64)).astype(np.float32))
    for name in ("attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        writer.add_tensor(f"blk.0.{name}.weight", rng.normal(0, 0.02, (64, 64)).astype(np.float32))
    for name in ("attn_norm", "ffn_norm"):
        writer.add_tensor(f"blk.0.{name}.weight", np.ones(64, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64 // 32 * 18), dtype=np.uint8),
                      raw_dtype=GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight has type IQ4_NL.*--gguf-dense"):
        resolve_model(str(tmp_path / "iq.gguf"), native_gguf=True)


@pytest.mark.parametrize("quant", ["q4_0", "q4_k_m"])
def test_a_moe_shape_is_served_in_place_with_the_dense_loads_tokens(quant, tmp_path_factory, embedded_path):
    """real_shapes' tiny-moe (olmoe, 8 experts of 128, 2 a token) as `bench peers --shape` writes it: every expert's
    gate/up and down a slice of the one mapping of the file (q4_k_m: Q4_K gate / up, ffn_down in llama.cpp's Q8_0
    fallback for rows of 128), and greedy tokens those of the same file loaded with --gguf-dense (fp32 activations in
    place: the same math to rounding; random weights' logits are flat, so one prompt may part at a near tie)."""
    gguf = shape_gguf("tiny-moe", quant, root=tmp_path_factory.mktemp("moe_shape"))
    prompts = [list(map(int, np.random.default_rng(n).integers(3, 40000, n))) for n in (1, 5, 17, 40)]
    tokens = {}
    for dense in (False, True):
        options = {} if dense else {"quant_options": {"activations": "fp32"}}
        llm = LLM(str(gguf), progress=False, dtype="float32", num_kv_blocks=128, gguf_dense=dense, **options)
        try:
            model = llm.engine.runner.model
            block = model.model.layers[0].mlp
            assert model.config.model_type == "olmoe" and model.config.num_experts_per_tok == 2
            assert len(block.experts) == 8 and block.experts[0].down_proj.in_features == 128
            if not dense:
                layers = [m for e in block.experts for m in (e.gate_up_proj, e.down_proj)]
                assert {q for m in layers for q, _ in m.segments.parts} == ({2} if quant == "q4_0" else {12, 8})
                views = [b for m in layers for _, b in m.segments.parts]
                assert len({b.data_ptr() for b in views}) == len(views) == 3 * 8
                assert len({b.untyped_storage().data_ptr() for b in views}) == 1
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
            tokens[dense] = [o.token_ids for o in outs]
        finally:
            llm.engine.close()
            shutil.rmtree(resolve_model(str(gguf), native_gguf=not dense))  # this file's index / conversion (108 MB)
    assert all(len(t) == 16 for t in tokens[False])
    assert sum(a == b for a, b in zip(tokens[False], tokens[True])) >= len(prompts) - 1, tokens
