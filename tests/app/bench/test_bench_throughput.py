"""`kvforge bench throughput --json`, run as a real subprocess on the embedded model (tiny sizes, no timing
assertions: only the shape of the report and the arithmetic that ties its figures together)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvforge.core.config import EngineConfig

NUM_REQUESTS, OUTPUT_LEN = 4, 4


@pytest.fixture(scope="module")
def report(embedded_path) -> dict:
    """The GGUF conversion happens (through embedded_path) before the subprocess starts."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "kvforge.app.cli", "bench", "throughput", "--num-requests", str(NUM_REQUESTS),
         "--output-len", str(OUTPUT_LEN), "--hf-sequential-requests", "1", "--hf-batch-size", "2", "--json"],
        capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # stdout is exactly one JSON object


def test_report_has_every_figure(report):
    assert {"model", "dtype", "threads", "num_requests", "output_len", "prompt_tokens", "kvforge",
            "hf_sequential", "hf_static_batch", "ratios"} <= set(report)
    assert {"total", "mean", "min", "max"} <= set(report["prompt_tokens"])
    assert {"generated_tokens", "wall_s", "output_tok_s", "total_tok_s", "ttft_s", "tpot_s",
            "prefix_cache_hit_rate", "preemptions"} <= set(report["kvforge"])
    for key in ("ttft_s", "tpot_s"):
        assert set(report["kvforge"][key]) == {"p50", "p99"}
        assert 0 < report["kvforge"][key]["p50"] <= report["kvforge"][key]["p99"]
    assert report["dtype"] == EngineConfig().dtype  # the default, "auto", named as what it resolved to here


def test_counts_are_plausible(report):
    prompt, ours = report["prompt_tokens"], report["kvforge"]
    assert report["num_requests"] == NUM_REQUESTS and report["output_len"] == OUTPUT_LEN
    assert 0 < prompt["min"] <= prompt["mean"] <= prompt["max"]
    assert prompt["total"] == pytest.approx(prompt["mean"] * NUM_REQUESTS)
    assert prompt["min"] < prompt["max"]  # varied lengths
    assert ours["requests_finished"] == NUM_REQUESTS
    assert ours["generated_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    assert 0 <= ours["prefix_cache_hit_rate"] <= 1 and ours["preemptions"] >= 0
    assert report["hf_sequential"]["requests"] == 1
    assert report["hf_sequential"]["generated_tokens"] == OUTPUT_LEN
    static = report["hf_static_batch"]
    assert (static["batch_size"], static["batches"], static["requests"]) == (2, 2, NUM_REQUESTS)
    assert static["generated_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    assert static["prompt_tokens"] == prompt["total"]


def test_throughputs_are_positive_and_consistent(report):
    ours = report["kvforge"]
    assert ours["output_tok_s"] > 0 and ours["total_tok_s"] > ours["output_tok_s"]
    assert ours["output_tok_s"] == pytest.approx(ours["generated_tokens"] / ours["wall_s"])
    assert ours["total_tok_s"] == pytest.approx(
        (report["prompt_tokens"]["total"] + ours["generated_tokens"]) / ours["wall_s"])
    for name in ("hf_sequential", "hf_static_batch"):
        hf = report[name]
        assert hf["output_tok_s"] > 0
        assert hf["output_tok_s"] == pytest.approx(hf["generated_tokens"] / hf["time_s"])
    ratios = report["ratios"]
    assert ratios["kvforge_vs_hf_sequential"] == pytest.approx(
        ours["output_tok_s"] / report["hf_sequential"]["output_tok_s"])
    assert ratios["kvforge_vs_hf_static_batch"] == pytest.approx(
        ours["output_tok_s"] / report["hf_static_batch"]["output_tok_s"])
