"""`kvforge bench defaults --json`, run as a real subprocess on the embedded model in its default configuration (tiny
sizes, no timing assertions: the report's shape, the three settings, shares that add up, and the guard's count
agreeing with the replies it reads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvforge.app.bench.defaults import first_loop
from kvforge.core.repetition import MIN_SPAN


def test_defaults_bench_report(embedded_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "kvforge.app.cli", "bench", "defaults", "--questions", "2", "--seeds", "2",
         "--max-tokens", "12", "--json"], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # stdout is exactly one JSON object
    assert report["model_defaults_source"] == "kvforge bench defaults (embedded Q4_1)" and report["questions"] == 2
    rows = report["settings"]
    assert list(rows) == ["neutral", "old-ui", "low", "greedy", "model"]
    assert rows["model"]["sampling"] == rows["greedy"]["sampling"] == {"temperature": 0.0}
    for row in rows.values():
        assert row["replies"] == 4 and 0 < row["mean_tokens"] <= 12
        assert row["ended_by_eos"] + row["ran_to_max_tokens"] == 1  # 12 tokens: nothing loops yet
        assert row["looping"] == row["guard_saves_tokens"] == 0
        assert 0 <= row["fact_found"] <= 1


def test_the_guards_count_is_where_it_ends_a_loop():
    assert first_loop([3] * 100) == MIN_SPAN and first_loop(list(range(100))) is None
