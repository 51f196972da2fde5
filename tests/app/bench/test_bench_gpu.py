"""`kvforge bench gpu --smoke`, run as a real subprocess on the CPU with the tiny random Llama and Qwen2
models: every phase's header, parity PASS, a throughput row per batch size, graphs on / off rows and the
JSON fields (no timing assertions: machines are shared). Without --smoke and without CUDA: exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kvforge.app.bench.gpu import NEEDS_CUDA
from kvforge.app.bench.random_models import synthetic_tokenizer
from kvforge.app.bench.references import logprobs_close

TINY = ("tiny-llama", "tiny-qwen2")
HEADERS = ("== 1/5 device and copy bandwidth ==", "== 2/5 parity with HF transformers",
           "== 3/5 batch-1 decode vs the bandwidth roofline", "== 4/5 throughput: N sequences at once",
           "== 5/5 CUDA graphs on vs off", "== targets ==")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, embedded_path):
    out = tmp_path_factory.mktemp("bench-gpu") / "result.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "gpu", "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def test_every_phase_prints_its_header(smoke):
    stdout, _ = smoke
    for header in HEADERS:
        assert header in stdout, header
    assert re.search(r"total [\d.]+ s \(budget \d+ s\); all phases ran", stdout)


def test_parity_passes_for_both_tiny_models(smoke):
    stdout, report = smoke
    assert [m["model"] for m in report["models"]] == list(TINY)
    for model in report["models"]:
        assert model["errors"] == {} and model["skipped"] == {}, model["errors"]
        for key in ("graphs_on", "graphs_off"):
            parity = model["parity"][key]
            assert parity["verdict"] == "PASS", parity
            assert parity["first_token_max_abs_logprob_diff"] <= parity["tolerance"]
            assert [p["prompt_len"] for p in parity["prompts"]] == [5, 17, 40]
        assert re.search(rf"^{model['model']}\s+PASS \(graphs on\), PASS \(graphs off\)", stdout, re.M)


def test_throughput_row_per_batch_size_with_a_ratio(smoke):
    stdout, report = smoke
    for model in report["models"]:
        assert sorted(model["throughput"], key=int) == ["1", "4"]
        for n, row in model["throughput"].items():
            assert row["kvforge"]["output_tok_s"] > 0 and row["hf"]["output_tok_s"] > 0
            assert row["kvforge"]["generated_tokens"] == int(n) * 8 == row["hf"]["generated_tokens"]
            assert row["ratio"] == pytest.approx(row["kvforge"]["output_tok_s"] / row["hf"]["output_tok_s"])
            assert re.search(rf"^{model['model']}\s+{n}\s+[\d.]+\s+[\d.]+\s+[\d.]+x$", stdout, re.M)


def test_graphs_on_and_off_rows(smoke):
    stdout, report = smoke
    for model in report["models"]:
        graphs = model["graphs"]
        for tag in ("on", "off"):
            assert sorted(graphs[tag], key=int) == ["1", "4"] and all(v > 0 for v in graphs[tag].values())
        assert graphs["same_tokens"] == {"1": "1/1", "4": "4/4"}  # eager on the CPU either way
        for n in ("1", "4"):
            assert re.search(rf"^{model['model']}\s+{n}\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+\d+/{n}$", stdout, re.M)


def test_json_has_the_fields(smoke):
    _, report = smoke
    assert report["ok"] is True and report["failures"] == [] and report["errors"] == {}
    assert report["options"]["smoke"] is True and report["options"]["device"] == "cpu"
    assert report["device"]["device"] == "cpu" and report["bandwidth"]["gb_per_s"] > 0
    assert report["total_s"] > 0 and len(report["targets"]) == 2 * len(TINY)
    for model in report["models"]:
        decode = model["decode"]
        assert decode["tok_s"] > 0 and decode["roofline_tok_s"] > 0 and decode["fraction_of_roofline"] > 0
        assert 0 < decode["weight_bytes_read_per_token"] < decode["weight_bytes"] == model["weight_bytes"]
        assert model["config"]["architectures"] == [{"tiny-llama": "LlamaForCausalLM",
                                                     "tiny-qwen2": "Qwen2ForCausalLM"}[model["model"]]]
        for step in ("build", "hf_parity_reference", "hf_throughput", "engine_graphs_on", "parity", "decode",
                     "throughput", "graphs_on", "engine_graphs_off", "graphs_off", "parity_graphs_off"):
            assert step in model["done"] and model["timings"][step] >= 0, step


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_and_without_smoke_exits_2(capsys):
    from kvforge.app.cli import main

    assert main(["bench", "gpu"]) == 2
    assert NEEDS_CUDA in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (("--smoke", "--models", "qwen2-0.5b"), "--models: unknown model 'qwen2-0.5b'"),
    (("--smoke", "--batches", "1,0"), "--batches must be integers >= 1"),
    (("--smoke", "--dtype", "float8"), "--dtype must be one of"),
])
def test_bad_arguments_exit_2(args, message, capsys):
    from kvforge.app.cli import main

    assert main(["bench", "gpu", *args]) == 2
    assert message in capsys.readouterr().err


def _top(*ids: int) -> SimpleNamespace:
    return SimpleNamespace(top=[(t, -1.0) for t in ids])


def test_logprobs_close_rule():
    theirs = torch.full((10,), -10.0)
    theirs[[1, 2, 3, 4, 5]] = torch.tensor([-1.0, -1.1, -1.2, -1.3, -1.4])
    hf = [theirs] * 3
    assert logprobs_close([1, 1, 1], [_top(1, 2)] * 3, [1, 1, 1], hf) == {"ok": True, "diverged_at": None,
                                                                         "reason": None}
    # a near tie: each token in the other's top-5 ends the comparison, whatever follows
    assert logprobs_close([1, 2, 9], [_top(2, 1)] * 3, [1, 1, 1], hf)["diverged_at"] == 1
    assert logprobs_close([1, 2, 9], [_top(2, 1)] * 3, [1, 1, 1], hf)["ok"]
    # kvforge's token outside HF's top-5, or HF's outside kvforge's
    assert not logprobs_close([1, 7], [_top(7, 1)] * 2, [1, 1], hf)["ok"]
    assert not logprobs_close([1, 2], [_top(2, 3)] * 2, [1, 1], hf)["ok"]


def test_synthetic_tokenizer_when_the_embedded_model_is_missing(tmp_path):
    from kvforge.core.tokenizer import Tokenizer

    tokenizer = Tokenizer(synthetic_tokenizer(tmp_path / "tok", vocab=64))
    assert tokenizer.eos_token_ids == {2} and tokenizer.encode("t5 t63") == [5, 63]
    detokenizer = tokenizer.detokenizer()
    assert "".join(detokenizer.step(t) for t in (5, 7)) == "t5 t7"
