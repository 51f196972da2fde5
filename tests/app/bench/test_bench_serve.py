"""`kvforge bench serve --json`, run as a real subprocess on the embedded model (tiny sizes, no timing
assertions: only the shape of the report and the counts that tie it together). By default the bench starts a
`kvforge serve` subprocess of its own and runs the offline engine on the same requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvforge.app.bench.serve import combine_rounds, tagged
from kvforge.core.config import EngineConfig

LEVELS, MAX_TOKENS = [1, 2], 4


def bench_serve(*args: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "serve", *args, "--json"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # stdout is exactly one JSON object


@pytest.fixture(scope="module")
def report(embedded_path) -> dict:
    """The GGUF conversion happens (through embedded_path) before the subprocess starts."""
    return bench_serve("--concurrency", ",".join(map(str, LEVELS)), "--requests-per-client", "1",
                       "--max-tokens", str(MAX_TOKENS), "--threads", "1")


def test_report_shape(report):
    assert {"model", "dtype", "threads", "cpu", "server", "requests_per_client", "max_tokens", "levels"} <= set(report)
    assert report["dtype"] == EngineConfig().dtype and report["max_tokens"] == MAX_TOKENS
    assert report["server"] == "process" and report["threads"] == 1
    assert [level["concurrency"] for level in report["levels"]] == LEVELS
    for level in report["levels"]:
        assert {"requests", "output_tokens", "wall_s", "requests_per_s", "output_tok_s", "ttft_s",
                "tpot_s", "offline", "http_vs_offline", "server_cpu_ms_per_token"} <= set(level)
        for key in ("ttft_s", "tpot_s"):
            assert set(level[key]) == {"p50", "p99"}
            assert 0 < level[key]["p50"] <= level[key]["p99"]


def test_counts_and_throughputs(report):
    for level in report["levels"]:
        assert level["requests"] == level["concurrency"]  # one request per client
        assert level["output_tokens"] == level["requests"] * MAX_TOKENS  # ignore_eos: every token generated
        assert level["wall_s"] > 0 and level["requests_per_s"] > 0 and level["output_tok_s"] > 0
        assert level["output_tok_s"] == pytest.approx(level["output_tokens"] / level["wall_s"])


def test_the_offline_engine_ran_the_same_requests(report):
    for level in report["levels"]:
        offline = level["offline"]
        assert offline["requests"] == level["requests"] and offline["output_tokens"] == level["output_tokens"]
        assert level["http_vs_offline"] == pytest.approx(level["output_tok_s"] / offline["output_tok_s"])
        assert level["server_cpu_ms_per_token"] > 0 and offline["cpu_ms_per_token"] > 0


def test_the_in_process_server_without_offline_runs(embedded_path):
    report = bench_serve("--server", "thread", "--no-offline", "--concurrency", "1", "--requests-per-client", "1",
                         "--max-tokens", "2", "--threads", "1")
    (level,) = report["levels"]
    assert report["server"] == "thread" and level["output_tokens"] == 2
    assert level["offline"] is None and level["http_vs_offline"] is None


def test_request_sets_differ_only_in_the_user_messages():
    messages = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    assert tagged(messages, 0) == messages
    assert tagged(messages, 2) == [[{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Request set 3. Hi"}]]


def test_rounds_combine_into_medians():
    def run(tok_s: float) -> dict:
        return {"concurrency": 2, "requests": 2, "output_tokens": 8, "output_tok_s": tok_s, "wall_s": 8 / tok_s,
                "ttft_s": {}, "tpot_s": {}, "ttft_samples": [tok_s], "tpot_samples": [tok_s]}

    row = combine_rounds([(run(10.0), run(20.0)), (run(30.0), run(40.0)), (run(50.0), run(50.0))])
    assert row["output_tok_s"] == 30.0 and row["offline"]["output_tok_s"] == 40.0
    assert row["http_vs_offline"] == 0.75  # the median of 0.5, 0.75 and 1.0: each round's ratio, not of the medians
    assert row["requests"] == 2 and row["ttft_s"] == {"p50": 30.0, "p99": pytest.approx(49.6)}
    assert [r["output_tok_s"] for r in row["rounds"]] == [10.0, 30.0, 50.0]


def test_bad_concurrency_is_a_clear_error(capsys):
    from kvforge.app.cli import main

    assert main(["bench", "serve", "--concurrency", "0,x"]) == 2  # in this process: an exception would fail the test
    assert "--concurrency" in capsys.readouterr().err
