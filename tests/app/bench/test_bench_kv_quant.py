"""`kvforge bench kv-quant --json`, run as a real subprocess on the embedded model at tiny sizes: a row per KV type
with the full-precision one first, capacities in the formats' byte ratios, perplexities close to full precision's,
an agreement share, both decode rates and their ratios (no timing assertions: machines are shared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_every_kv_type_has_its_figures(embedded_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "kv-quant", "--types", "q4,int8",
                             "--dtype", "float32", "--text-tokens", "128", "--generate", "16", "--decode-tokens", "4",
                             "--batch", "2", "--context", "64", "--repeats", "1", "--batch-steps", "3", "--kv-gb",
                             "0.0625", "--json"],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["kv_cache_dtype"]: row for row in json.loads(result.stdout)}
    assert list(rows) == ["auto", "q4", "int8"]  # full precision first: the reference
    auto, int8, q4 = rows["auto"], rows["int8"], rows["q4"]
    # fp32, head_dim 64: 256 bytes a row against 66 and 40
    assert int8["pool_tokens"] / auto["pool_tokens"] > 3.8 and q4["pool_tokens"] / auto["pool_tokens"] > 6.3
    assert auto["kv_bytes_per_token"] / int8["kv_bytes_per_token"] == 256 / 66
    assert auto["top1_agreement"] is None and 0.8 <= int8["top1_agreement"] <= 1 and 0.5 <= q4["top1_agreement"] <= 1
    assert 1 < auto["perplexity"] and abs(int8["perplexity"] / auto["perplexity"] - 1) < 0.03
    for row in rows.values():
        assert row["decode_b1_tok_s"] > 0 and row["decode_batch_tok_s"] > 0
        assert row["b1_ratio"] > 0 and row["batch_ratio"] > 0  # timed in turn with full precision's runs
    assert auto["b1_ratio"] == auto["batch_ratio"] == 1.0


def test_an_unknown_type_is_refused_before_anything_loads():
    result = subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "kv-quant", "--types", "q8_0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--types: unknown KV cache type 'q8_0'" in result.stderr
