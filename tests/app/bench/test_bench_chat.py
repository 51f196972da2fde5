"""`kvforge bench chat --json`, run as a real subprocess on the embedded model with small settings (no timing
assertions: only the shape of the report, the cache hits and the token-for-token reply check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TURNS = 2  # the second turn reads the first from memory and from disk: every mode's path


@pytest.fixture(scope="module")
def report(embedded_path, tmp_path_factory) -> dict:
    """The GGUF conversion happens (through embedded_path) before the subprocess starts. TMPDIR is private,
    so the test can check that the temporary data directory of the persisted mode is removed."""
    tmp = tmp_path_factory.mktemp("bench-chat-tmp")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TMPDIR=str(tmp))
    # llama.cpp is no part of CI: pointed at an interpreter that does not exist, it must be reported as skipped
    missing = tmp_path_factory.mktemp("no-peers-here") / "python"
    result = subprocess.run(
        [sys.executable, "-m", "kvforge.app.cli", "bench", "chat", "--turns", str(TURNS), "--reply-tokens", "8",
         "--user-tokens", "40", "--kv-cache-gb", "0.25", "--llama-python", str(missing), "--json"],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert list(tmp.iterdir()) == []
    return json.loads(result.stdout)  # stdout is exactly one JSON object


def test_report_shape(report):
    assert {"model", "dtype", "threads", "block_size", "turns", "user_tokens", "reply_tokens", "per_turn",
            "replies_identical", "replies_identical_by_mode", "disk", "target", "wall_s"} <= set(report)
    assert report["turns"] == TURNS and report["reply_tokens"] == 8 and report["user_tokens"] == 40
    assert [t["turn"] for t in report["per_turn"]] == list(range(1, TURNS + 1))
    for t in report["per_turn"]:
        assert set(t["ttft_s"]) == set(t["cached_tokens"]) == {"no_cache", "memory", "persisted"}
        assert all(v > 0 for v in t["ttft_s"].values())
        assert t["ratio_memory"] > 0 and t["ratio_persisted"] > 0
        assert t["ratio_persisted"] == pytest.approx(t["ttft_s"]["persisted"] / t["ttft_s"]["no_cache"])
        assert 1 <= t["reply_tokens"] <= 8
    prompts = [t["prompt_tokens"] for t in report["per_turn"]]
    assert prompts == sorted(prompts) and prompts[-1] - prompts[0] >= (TURNS - 1) * 40  # each turn adds its message
    target = report["target"]
    assert target["turn"] == TURNS and target["max_ratio"] == 0.2
    assert target["ratio_persisted"] == report["per_turn"][-1]["ratio_persisted"]
    assert target["met"] == (target["ratio_persisted"] <= 0.2)


def test_replies_identical_in_every_mode(report):
    assert report["replies_identical"] is True
    assert report["replies_identical_by_mode"] == {"memory": True, "persisted": True}


def test_cache_hits(report):
    block = report["block_size"]
    for t in report["per_turn"]:
        cached = t["cached_tokens"]
        assert cached["no_cache"] == 0
        # after a restart the disk holds exactly what the in-memory cache held: the earlier turns
        assert cached["persisted"] == cached["memory"]
        if t["turn"] >= 2:
            assert cached["memory"] > 0
    disk = report["disk"]
    assert disk["flushed"] and disk["written_blocks"] > 0 and disk["bytes"] > 0 and disk["load_failures"] == 0
    assert disk["loaded_blocks"] == sum(t["cached_tokens"]["persisted"] for t in report["per_turn"]) // block


def test_bad_arguments_are_a_clear_error(capsys):
    from kvforge.app.cli import main

    assert main(["bench", "chat", "--turns", "0"]) == 2  # in this process: an exception would fail the test
    assert "--turns" in capsys.readouterr().err
    assert main(["bench", "chat", "--kv-cache-gb", "0"]) == 2
    assert "--kv-cache-gb must be > 0" in capsys.readouterr().err


def test_llama_cpp_is_reported_as_skipped_where_it_cannot_run(report, tmp_path):
    assert report["llama_cpp"]["status"] == "skipped"
    assert "no-peers-here" in report["llama_cpp"]["why"] and "--llama-python" in report["llama_cpp"]["why"]
    assert all(t["llama_cpp"] is None for t in report["per_turn"])
    # a model that is no GGUF file: llama.cpp cannot be given it, whatever is installed
    import argparse

    from kvforge.app.bench.chat import _llama_cpp_turns

    args = argparse.Namespace(model=str(tmp_path), no_peers=False, llama_python=None, peers_dir=None)
    assert _llama_cpp_turns(args, {}) == {"status": "skipped", "why": "llama.cpp runs GGUF files only"}
