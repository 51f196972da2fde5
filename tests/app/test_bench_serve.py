"""`kvforge bench serve --json`, run as a real subprocess on the embedded model (tiny sizes, no timing
assertions: only the shape of the report and the counts that tie it together)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LEVELS, MAX_TOKENS = [1, 2], 4


@pytest.fixture(scope="module")
def report(embedded_path) -> dict:
    """The GGUF conversion happens (through embedded_path) before the subprocess starts."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "kvforge.app.cli", "bench", "serve", "--concurrency", ",".join(map(str, LEVELS)),
         "--requests-per-client", "1", "--max-tokens", str(MAX_TOKENS), "--json"],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # stdout is exactly one JSON object


def test_report_shape(report):
    assert {"model", "dtype", "threads", "requests_per_client", "max_tokens", "levels"} <= set(report)
    assert report["dtype"] == "float32" and report["max_tokens"] == MAX_TOKENS
    assert [level["concurrency"] for level in report["levels"]] == LEVELS
    for level in report["levels"]:
        assert {"requests", "output_tokens", "wall_s", "requests_per_s", "output_tok_s", "ttft_s",
                "tpot_s"} <= set(level)
        for key in ("ttft_s", "tpot_s"):
            assert set(level[key]) == {"p50", "p99"}
            assert 0 < level[key]["p50"] <= level[key]["p99"]


def test_counts_and_throughputs(report):
    for level in report["levels"]:
        assert level["requests"] == level["concurrency"]  # one request per client
        assert level["output_tokens"] == level["requests"] * MAX_TOKENS  # ignore_eos: every token generated
        assert level["wall_s"] > 0 and level["requests_per_s"] > 0 and level["output_tok_s"] > 0
        assert level["output_tok_s"] == pytest.approx(level["output_tokens"] / level["wall_s"])


def test_bad_concurrency_is_a_clear_error():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "serve", "--concurrency", "0,x"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0 and "--concurrency" in result.stderr and "Traceback" not in result.stderr
