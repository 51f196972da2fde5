"""`kvforge bench structured --json`, run as a real subprocess on the embedded model in its default
configuration (tiny sizes, no timing assertions: the report's shape, and every sampled output valid)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_structured_bench_report(embedded_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "kvforge.app.cli", "bench", "structured", "--batch-sizes", "1,2", "--output-len", "4",
         "--rounds", "1", "--validity-requests", "3", "--json"],
        capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # stdout is exactly one JSON object
    assert report["quant"] == "gguf"  # the default path: the embedded GGUF served from its own blocks
    assert [row["batch_size"] for row in report["batches"]] == [1, 2]
    for row in report["batches"]:
        assert row["free_decode_tok_s"] > 0 and row["constrained_decode_tok_s"] > 0
        assert row["constrained_vs_free"] == row["constrained_decode_tok_s"] / row["free_decode_tok_s"]
    validity = report["validity"]
    assert validity["requests"] == 3 and validity["checked_with"] == "jsonschema"
    assert validity["finished"] > 0 and validity["valid"] == validity["finished"]
