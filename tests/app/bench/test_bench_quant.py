"""`kvforge bench quant --json`, run as a real subprocess on the embedded model at tiny sizes: the rows,
the memory ordering and the perplexities (no timing assertions: machines are shared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "quant", *args],
                          capture_output=True, text=True, timeout=900, env=env)


@pytest.fixture(scope="module")
def rows(embedded_path) -> dict:
    result = _bench("--methods", "fp32,gptq,bnb-int8", "--prompt-tokens", "16", "--decode-tokens", "4",
                    "--concurrency", "2", "--repeats", "1", "--no-llama-cpp", "--json")
    assert result.returncode == 0, result.stderr
    return {row["method"]: row for row in json.loads(result.stdout)}


def test_every_method_has_its_figures(rows):
    assert list(rows) == ["fp32", "gptq", "bnb-int8"]
    for row in rows.values():
        assert row["decode_tok_s"] > 0 and row["concurrent_tok_s"] > 0
        assert row["perplexity"] > 1 and row["weight_bytes"] > 0
    assert rows["fp32"]["dtype"] == "float32" and rows["gptq"]["dtype"] == "bfloat16"


def test_quantized_weights_are_smaller_and_perplexity_close(rows):
    fp32 = rows["fp32"]
    assert rows["gptq"]["weight_bytes"] < rows["bnb-int8"]["weight_bytes"] < fp32["weight_bytes"]
    assert rows["bnb-int8"]["perplexity"] / fp32["perplexity"] < 1.03
    assert rows["gptq"]["perplexity"] / fp32["perplexity"] < 1.25


@pytest.mark.parametrize("args, message", [
    (("--methods", "fp32,int3"), "unknown method 'int3'"),
    (("--decode-tokens", "0"), "--decode-tokens must be >= 1"),
    (("--dtype", "float8"), "dtype must be one of"),
])
def test_bad_arguments_are_refused_before_loading(args, message, embedded_path, capsys, monkeypatch):
    """Through main() in this process (an interpreter start each cost seconds): an exception fails the test, and
    loading a model fails it too."""
    from kvforge.app.bench import quant
    from kvforge.app.cli import main

    monkeypatch.setattr(quant, "measure", lambda *a, **k: pytest.fail("a model was loaded"))
    status = main(["bench", "quant", *args, "--no-llama-cpp"])
    err = capsys.readouterr().err
    assert status == 2 and message in err, err
