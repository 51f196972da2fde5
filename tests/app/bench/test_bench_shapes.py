"""Random-weight models of real shapes (app/bench/real_shapes.py) and what `kvforge bench peers --shape` adds (the
roofline, memory per engine): on the tiny shape (hidden 256, 2 layers, the embedded 49152-token tokenizer), and its
mixture-of-experts one tiny-moe (llama.cpp's olmoe layout), written once per module into a temporary cache (kvforge
serving tiny-moe in place: tests/core/test_gguf_source.py).

The gguf package's GGUFReader builds a numpy view per token of the vocabulary (~5 s here): it reads one file once
and transformers' GGUF loader is handed the same reader (it would read the file twice more). The other files'
tensors are checked through kvforge's own header reader. llama-cpp-python is not part of CI (like the peers of
test_bench_peers.py): its check runs where the peers dir has it and is skipped, with why, elsewhere, even under
KVFORGE_REQUIRE_ALL."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvforge.app.bench import real_shapes
from kvforge.app.bench import shape_twin as twin_module
from kvforge.app.bench.real_shapes import QUANTS, SHAPES, TEST_SHAPES, shape_gguf, tensor_shapes, tensor_types
from kvforge.app.bench.shape_twin import shape_twin

TINY, TINY_MOE = TEST_SHAPES["tiny"], TEST_SHAPES["tiny-moe"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, embedded_path):
    """The tiny shape's GGUF in every quantization and its twin, in shards of at most 16 MiB (so the index is
    exercised: the embedding alone is 24 MiB, a shard of its own)."""
    root = tmp_path_factory.mktemp("bench_shapes")
    ggufs = {q: shape_gguf("tiny", q, root=root) for q in QUANTS}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(twin_module, "SHARD_BYTES", 16 << 20)
        twin = shape_twin("tiny", root=root, tokenizer_dir=embedded_path)
    return root, ggufs, twin


@pytest.fixture(scope="module")
def moe_files(files):
    """tiny-moe's GGUF in q4_0 and q4_k_m (its ffn_down rows of 128 take llama.cpp's Q8_0 fallback there)."""
    return {q: shape_gguf("tiny-moe", q, root=files[0]) for q in ("q4_0", "q4_k_m")}


@pytest.fixture(scope="module")
def reader(files):
    import gguf

    return gguf.GGUFReader(str(files[1]["q4_0"]))


def test_the_mixes_follow_llama_cpp(files):
    from gguf import GGMLQuantizationType as T

    untied, tied = tensor_types(SHAPES["8b"], "q4_0"), tensor_types(SHAPES["1.7b"], "q4_k_m")
    assert untied["token_embd.weight"] == T.Q8_0 and untied["output.weight"] == T.Q6_K
    assert untied["blk.31.ffn_down.weight"] == untied["blk.0.attn_q.weight"] == T.Q4_0
    assert "output.weight" not in tied and tied["token_embd.weight"] == T.Q6_K  # a tied head is Q6_K
    assert tied["blk.5.attn_v.weight"] == tied["blk.6.ffn_down.weight"] == T.Q6_K
    assert tied["blk.5.attn_k.weight"] == tied["blk.6.ffn_up.weight"] == T.Q4_K
    assert tensor_types(SHAPES["8b"], "q4_k_m")["token_embd.weight"] == T.Q4_K
    assert set(tensor_types(SHAPES["3b"], "q8_0").values()) == {T.Q8_0, T.F32}
    assert tensor_shapes(SHAPES["8b"])["blk.0.attn_k.weight"] == (1024, 4096)  # 8 KV heads of 128
    assert tensor_shapes(SHAPES["8b"])["blk.0.ffn_down.weight"] == (4096, 14336)


def test_gguf_reader_sees_every_tensor_with_its_type_and_shape(files, reader):
    from gguf.quants import dequantize

    expected_types, expected_shapes = tensor_types(TINY, "q4_0"), tensor_shapes(TINY)
    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors) == list(expected_shapes)
    assert {t.tensor_type.name for t in tensors.values()} == {"F32", "Q4_0", "Q8_0", "Q6_K"}
    for name, t in tensors.items():
        assert t.tensor_type == expected_types[name]
        assert tuple(int(d) for d in reversed(t.shape)) == expected_shapes[name]  # the file stores ne[0] first
        weights = dequantize(t.data, t.tensor_type)
        assert weights.shape == expected_shapes[name] and np.isfinite(weights).all()
        if t.tensor_type.name == "F32":
            assert (weights == 1).all()  # norms
        else:
            assert np.abs(weights).max() <= real_shapes.WEIGHT_LIMIT * 1.01 and weights.std() > 0.002, name
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("tokenizer.ggml.", "GGUF."))}
    assert meta["general.architecture"] == "llama" and meta["general.file_type"] == 2  # MOSTLY_Q4_0
    assert meta["llama.embedding_length"] == 256 and meta["llama.block_count"] == 2
    assert meta["llama.feed_forward_length"] == 512 and meta["llama.context_length"] == 2048
    assert (meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]) == (4, 2)
    assert meta["llama.rope.dimension_count"] == 64 and meta["llama.vocab_size"] == 49152
    assert meta["tokenizer.chat_template"].startswith("{% for message in messages %}")
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49152


@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0"])
def test_the_other_quantizations_dequantize_within_the_limit(files, quant):
    """Their tensors through kvforge's header reader: types, shapes, and the blocks at each offset dequantized."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvforge.core.model_files import read_gguf_header

    path = files[1][quant]
    header = read_gguf_header(path)
    types, shapes = tensor_types(TINY, quant), tensor_shapes(TINY)
    assert [t.name for t in header.tensors] == list(shapes)
    data = np.memmap(path, np.uint8, mode="r")
    for t in header.tensors:
        qtype = GGMLQuantizationType(t.ggml_type)
        assert qtype == types[t.name] and tuple(reversed(t.shape)) == shapes[t.name]
        raw = data[header.data_offset + t.offset:header.data_offset + t.offset + t.n_bytes]
        if qtype == GGMLQuantizationType.F32:
            weights = np.asarray(raw).view(np.float32).reshape(shapes[t.name])
        else:
            weights = dequantize(np.asarray(raw).reshape(shapes[t.name][0], -1), qtype)
        assert weights.shape == shapes[t.name] and np.isfinite(weights).all()
        if qtype != GGMLQuantizationType.F32:
            assert np.abs(weights).max() <= real_shapes.WEIGHT_LIMIT * 1.01 and weights.std() > 0.002, t.name
            assert abs(weights.mean()) < 0.1 * weights.std(), t.name  # centred (Q4_K: dmin = 7.5 d)


def test_the_moe_shape_follows_llama_cpps_olmoe():
    """olmoe-1b-7b's tensors: the names gguf-py lists for MODEL_ARCH.OLMOE, stacked experts [E, rows, row length],
    the router F32, the projections in the quantization's types; its Q4_0 file ~3.97 GB (6.9B weights)."""
    from gguf import GGMLQuantizationType as T
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    olmoe = SHAPES["olmoe-1b-7b"]
    shapes, q4_0, q4_k_m = tensor_shapes(olmoe), tensor_types(olmoe, "q4_0"), tensor_types(olmoe, "q4_k_m")
    expected = {TENSOR_NAMES[t].format(bid=i) + ".weight" for t in MODEL_TENSORS[MODEL_ARCH.OLMOE]
                for i in range(olmoe.layers)}
    assert set(shapes) == expected
    assert shapes["blk.15.ffn_gate_exps.weight"] == shapes["blk.0.ffn_up_exps.weight"] == (64, 1024, 2048)
    assert shapes["blk.0.ffn_down_exps.weight"] == (64, 2048, 1024)
    assert shapes["blk.0.ffn_gate_inp.weight"] == (64, 2048)
    assert shapes["blk.0.attn_q_norm.weight"] == shapes["blk.0.attn_k_norm.weight"] == (2048,)
    assert q4_0["blk.0.ffn_gate_inp.weight"] == q4_k_m["blk.0.ffn_gate_inp.weight"] == T.F32
    assert q4_0["blk.3.ffn_down_exps.weight"] == q4_0["blk.0.attn_q.weight"] == T.Q4_0
    assert (q4_0["token_embd.weight"], q4_0["output.weight"]) == (T.Q8_0, T.Q6_K)
    assert q4_k_m["blk.0.ffn_down_exps.weight"] == q4_k_m["blk.0.attn_v.weight"] == T.Q6_K
    assert q4_k_m["blk.0.ffn_gate_exps.weight"] == T.Q4_K
    assert tensor_types(TINY_MOE, "q4_k_m")["blk.0.ffn_down_exps.weight"] == T.Q8_0  # rows of 128: the fallback
    size = sum(int(np.prod(d)) * 4 if q4_0[n] == T.F32 else real_shapes.tensor_nbytes(d, q4_0[n])
               for n, d in shapes.items())
    assert size == 3_973_324_800 and sum(int(np.prod(d)) for d in shapes.values()) == 6_914_443_264
    assert "64 experts of FFN 1024, 8 a token" in olmoe.describe()


def test_the_moe_gguf_is_llama_cpps_olmoe_file(moe_files):
    """tiny-moe through kvforge's header reader: olmoe's metadata as llama.cpp's converter writes it, the stacked
    experts' blocks dequantized within the limit, a random F32 router; a decode step reads 2 of the 8 experts."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvforge.app.bench.roofline import decode_bytes
    from kvforge.core.model_files import read_gguf_header

    path = moe_files["q4_0"]
    header = read_gguf_header(path)
    meta = header.metadata
    assert meta["general.architecture"] == "olmoe" and meta["general.file_type"] == 2
    experts = (meta["olmoe.expert_count"], meta["olmoe.expert_used_count"], meta["olmoe.feed_forward_length"])
    assert experts == (8, 2, 128)  # feed_forward_length: one expert's
    assert (meta["olmoe.embedding_length"], meta["olmoe.block_count"], meta["olmoe.context_length"]) == (256, 2, 2048)
    assert (meta["olmoe.attention.head_count"], meta["olmoe.attention.head_count_kv"]) == (4, 4)
    assert "olmoe.vocab_size" not in meta and "olmoe.rope.dimension_count" not in meta  # LlamaModel's keys only
    types, shapes = tensor_types(TINY_MOE, "q4_0"), tensor_shapes(TINY_MOE)
    assert [t.name for t in header.tensors] == list(shapes)
    data = np.memmap(path, np.uint8, mode="r")
    for t in header.tensors:
        qtype, dims = GGMLQuantizationType(t.ggml_type), shapes[t.name]
        assert qtype == types[t.name] and tuple(reversed(t.shape)) == dims
        raw = np.asarray(data[header.data_offset + t.offset:header.data_offset + t.offset + t.n_bytes])
        if t.name.endswith("ffn_gate_inp.weight"):
            router = raw.view(np.float32).reshape(dims)
            assert np.abs(router).max() <= real_shapes.WEIGHT_LIMIT and router.std() > 0.005
        elif len(dims) == 3:
            weights = dequantize(raw.reshape(*dims[:-1], -1), qtype)
            assert weights.shape == dims and np.abs(weights).max() <= real_shapes.WEIGHT_LIMIT * 1.01
            assert weights.std(axis=(1, 2)).min() > 0.002  # every expert random
    # per layer: q, k, v, o 256x256 in Q4_0, the F32 router 8x256, of each stacked 8x128x256 Q4_0 tensor 2 experts;
    # the output head 49152x256 in Q6_K
    layer = 4 * 256 * 256 // 32 * 18 + 8 * 256 * 4 + 3 * 2 * 128 * 256 // 32 * 18
    assert decode_bytes(path) == {"bytes": 2 * layer + 49152 * 210, "tensors": 17, "head": "output.weight",
                                  "experts": "2 of 8"}


def test_the_moe_twin_is_an_olmoe_checkpoint(files, embedded_path):
    """tiny-moe's twin: OlmoeForCausalLM, each expert's tensors under its own name (as published OLMoE checkpoints),
    loaded by transformers."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    twin = shape_twin("tiny-moe", root=files[0], tokenizer_dir=embedded_path)
    config = json.loads((twin / "config.json").read_text())
    assert config["architectures"] == ["OlmoeForCausalLM"] and config["num_experts"] == 8
    assert (config["num_experts_per_tok"], config["intermediate_size"], config["clip_qkv"]) == (2, 128, None)
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    assert type(model).__name__ == "OlmoeForCausalLM" and model.config.num_experts == 8
    with safe_open(twin / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(twin_module.twin_tensors(TINY_MOE))
        down = f.get_tensor("model.layers.1.mlp.experts.7.down_proj.weight")
    assert down.shape == (256, 128)
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj[7], down.float())  # stacked by transformers 5
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_transformers_loads_the_gguf_and_generates(files, reader, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM

    root, ggufs, _ = files
    real_reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *a, **k: (
        reader if Path(path) == ggufs["q4_0"] else real_reader(path, *a, **k)))
    model = AutoModelForCausalLM.from_pretrained(root, gguf_file=ggufs["q4_0"].name, dtype=torch.float32)
    assert model.config.num_hidden_layers == 2 and model.config.num_key_value_heads == 2
    assert not model.config.tie_word_embeddings and model.config.vocab_size == 49152
    ids = torch.tensor([[1, 9690, 198, 2683, 359]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, 49152) and torch.isfinite(logits).all() and logits.std() > 0
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 8)


def test_the_twin_is_sharded_and_loads_in_transformers(files):
    from transformers import AutoModelForCausalLM

    _, _, twin = files
    index = json.loads((twin / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((twin / s).stat().st_size <= 25 << 20 for s in shards)
    assert (twin / "tokenizer.json").is_file() and (twin / "chat_template.jinja").is_file()
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (256, 2, 512)
    assert config.architectures == ["LlamaForCausalLM"] and not config.tie_word_embeddings
    weight = model.model.layers[1].mlp.down_proj.weight
    assert weight.std().item() == pytest.approx(0.02, rel=0.05)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_files_are_reused(files, embedded_path):
    root, ggufs, twin = files
    before = {p: p.stat().st_mtime_ns for p in (*ggufs.values(), twin / "config.json")}
    assert shape_gguf("tiny", "q4_0", root=root) == ggufs["q4_0"]
    assert shape_twin("tiny", root=root, tokenizer_dir=embedded_path) == twin
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temporary file left behind


def test_roofline_arithmetic(files):
    from kvforge.app.bench.roofline import decode_bytes, roofline_tok_s, stream_bandwidth

    # per layer: q, o 256x256 and k, v 128x256 in Q4_0 (18 bytes per 32 weights), gate, up, down 512x256; the output
    # head 49152x256 in Q6_K (210 bytes per 256); token_embd (untied) and the norms are not read in full
    layer = (2 * 256 * 256 + 2 * 128 * 256 + 3 * 512 * 256) // 32 * 18
    head = 49152 * 256 // 256 * 210
    step = decode_bytes(files[1]["q4_0"])
    assert step == {"bytes": 2 * layer + head, "tensors": 15, "head": "output.weight", "experts": None}
    assert roofline_tok_s(10e9, step["bytes"]) == pytest.approx(10e9 / 10_985_472)
    threads = torch.get_num_threads()
    measured = stream_bandwidth(1, nbytes=16 << 20, repeats=2)
    assert measured["bytes_per_s"] > 0 and len(measured["seconds"]) == 2 and torch.get_num_threads() == threads


def test_worker_reads_the_memory_of_its_process_tree():
    from kvforge.app.bench.peer_worker import memory

    alone = memory()
    assert alone["rss_bytes"] > 0 and alone["peak_rss_bytes"] >= alone["rss_bytes"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert memory()["processes"] == alone["processes"] + 1
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("argv, message", [
    (["--shape", "2b"], "--shape '2b': unknown (choose from 1.7b, 3b, 8b, olmoe-1b-7b, tiny, tiny-moe)"),
    (["--shape", "tiny", "--quant", "q5_k"], "--quant 'q5_k': unknown (choose from q4_0, q4_k_m, q8_0, f16)"),
    (["--quant", "q8_0"], "--quant is for --shape"),
    (["--shape", "tiny", "--gguf", "x.gguf"], "--shape and --gguf: choose one"),
])
def test_cli_refuses_bad_shape_options(argv, message, capsys):
    from kvforge.app.cli import main

    assert main(["bench", "peers", *argv]) == 2
    assert message in capsys.readouterr().err


def test_peers_with_shape_run_the_gguf_and_the_twin_and_report_the_roofline(files, monkeypatch, tmp_path, capsys):
    """run_peers in this process with the engines' workers replaced: which model each engine gets, the defaults of
    --shape, and the summary's arithmetic."""
    from kvforge.app.bench import peers, roofline

    root, ggufs, twin = files
    monkeypatch.setattr(real_shapes, "shapes_dir", lambda: root)
    monkeypatch.setattr(twin_module, "shapes_dir", lambda: root)
    monkeypatch.setattr(roofline, "stream_bandwidth", lambda threads: {
        "bytes_per_s": 5e9, "how": "stand-in", "threads": threads})
    jobs = []

    def fake_run_engine(run, job, workdir, timeout, env):
        jobs.append((run.engine.name, job))
        tpot = 0.1 if run.engine.name == "kvforge-gguf" else 0.05
        run.seconds = 3.0
        run.info |= {"library": "fake", "load_s": 2.0, "rss_bytes_after_load": 3 << 30, "peak_rss_bytes": 4 << 30}
        for batch in job["batches"]:
            n = job["requests"][str(batch)]
            run.measurements.append({"batch": batch, "requests": n, "generated_tokens": n * job["output_tokens"],
                                     "wall_s": 1.0, "ttft_s": [0.2] * n, "tpot_s": [tpot] * n, "timing": "fake"})
        return run

    monkeypatch.setattr(peers, "run_engine", fake_run_engine)
    monkeypatch.setenv("KVFORGE_PEERS_DIR", str(tmp_path / "no-peers-here"))
    for variable in ("KVFORGE_VLLM_PYTHON", "KVFORGE_LLAMA_PYTHON"):
        monkeypatch.delenv(variable, raising=False)
    out = tmp_path / "report.json"
    parser = argparse.ArgumentParser()
    peers.add_parser(parser.add_subparsers())
    assert peers.run_peers(parser.parse_args(["peers", "--shape", "tiny", "--json", str(out)])) == 0
    report, stdout = json.loads(out.read_text()), capsys.readouterr().out

    status = {e["engine"]: e["status"] for e in report["engines"]}
    assert status == {"kvforge-gguf": "ok", "vllm-bf16": "skipped", "llama.cpp": "skipped"}  # --shape's defaults
    ((name, job),) = jobs
    assert name == "kvforge-gguf" and job["model"] == str(ggufs["q4_0"])
    assert job["batches"] == [1, 16] and job["output_tokens"] == 64 and report["options"]["prompts"] == 4
    shape = report["shape"]
    assert shape["decode_step"]["bytes"] == 10_985_472 and shape["twin"] is None  # no dense engine ran
    assert shape["roofline_tok_s"] == pytest.approx(5e9 / 10_985_472)
    (summary,) = report["summary"]
    assert summary["decode_tok_s_batch_1"] == pytest.approx(10.0) and summary["load_s"] == 2.0
    assert summary["of_roofline"] == pytest.approx(10.0 / shape["roofline_tok_s"])
    assert summary["output_tok_s"]["16"] == pytest.approx(16 * 64 / 1.0)
    assert "roofline" in stdout and "peak RSS" in stdout and f"{100 * summary['of_roofline']:.0f}%" in stdout
    assert report["cpu"]["family"] is None or isinstance(report["cpu"]["family"], int)

    jobs.clear()
    assert peers.run_peers(parser.parse_args(["peers", "--shape", "tiny", "--engines", "kvforge-bf16,hf-fp32",
                                              "--batches", "1", "--json", str(out)])) == 0
    assert [(n, j["model"]) for n, j in jobs] == [("hf-fp32", str(twin)), ("kvforge-bf16", str(twin))]
    assert json.loads(out.read_text())["shape"]["twin"] == str(twin)


def test_llama_cpp_loads_the_ggufs(files, moe_files):
    """llama-cpp-python (the peers dir's, not part of CI) loads each quantization, tiny-moe's olmoe files too, and
    computes finite logits and a few greedy tokens."""
    from kvforge.app.bench.peer_engines import find_peer

    args = argparse.Namespace(no_peers=False, llama_python=None, vllm_python=None, peers_dir=None)
    python, why = find_peer("llama", args)
    if python is None:
        pytest.skip(f"llama-cpp-python is not part of CI: {why}")
    script = textwrap.dedent("""
        import sys, numpy as np
        from llama_cpp import Llama
        for path in sys.argv[1:]:
            llm = Llama(model_path=path, n_ctx=64, n_threads=1, verbose=False, logits_all=True)
            ids = llm.tokenize(b"Hello there")
            llm.eval(ids)
            assert np.isfinite(np.asarray(llm.scores[:llm.n_tokens])).all(), path
            assert llm.n_vocab() == 49152
            llm.reset()
            out = llm.create_completion("Hello there", max_tokens=4, temperature=0)
            assert out["usage"]["completion_tokens"] >= 1, path
        print("ok")
    """)
    paths = [*files[1].values(), *moe_files.values()]
    result = subprocess.run([python, "-c", script, *map(str, paths)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
