"""`kvforge bench spec --json`, run as a real subprocess on the embedded model at tiny sizes: every row,
positive speedups, acceptance rates in [0, 1] in the default dtype, and greedy tokens equal to the baseline's in
every row in fp32 (no timing assertions: machines are shared). In bf16 (the default on CPUs that compute it
natively) a verify forward over 1 + k rows rounds its matmuls otherwise than a 1-row one, so a near-tie may part
the outputs: the bench's `same tokens` column reports it, exact losslessness is asserted in fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvforge.app.bench.spec import parse_config
from kvforge.app.bench.workloads import spec_prompts as bench_prompts


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kvforge.app.cli", "bench", "spec", *args],
                          capture_output=True, text=True, timeout=900, env=env)


def _bench_json(tmp_path_factory, *args: str) -> dict:
    out = tmp_path_factory.mktemp("bench-spec") / "spec.json"
    run = _bench("--max-tokens", "16", "--prompts", "1", "--threads", "2", "--json", str(out), *args)
    assert run.returncode == 0, run.stderr
    assert "same tokens" in run.stdout  # a JSON file comes with the table
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def result(embedded_path, tmp_path_factory) -> dict:
    return _bench_json(tmp_path_factory)  # the default dtype and configurations


FP32_CONFIGS = ("none", "ngram k=4", "draft layers=10")


@pytest.fixture(scope="module")
def fp32_result(result, tmp_path_factory) -> dict:
    """A run in fp32 of FP32_CONFIGS; where the default dtype is fp32 (CPUs without native bf16) the default run
    is that run already (the same dtype, and these configurations among its own), so its rows serve."""
    if result["dtype"] == "float32":
        return dict(result, rows=[row for row in result["rows"] if row["config"] in FP32_CONFIGS])
    return _bench_json(tmp_path_factory, "--dtype", "float32", *(f"--config={c}" for c in FP32_CONFIGS[1:]))


def test_every_configuration_and_task_has_a_row(result):
    rows = [(row["config"], row["task"]) for row in result["rows"]]
    configs = ["none", "ngram", "ngram k=4", "draft layers=10"]  # the embedded model has 30 layers
    assert rows == [(config, task) for config in configs for task in ("grounded", "chat")]
    assert result["tasks"] == {"grounded": 1, "chat": 1} and result["max_tokens"] == 16


def test_figures(result):
    for row in result["rows"]:
        assert isinstance(row["speedup"], float) and row["speedup"] > 0
        assert row["decode_tok_s"] > 0 and row["e2e_tok_s"] > 0
        assert isinstance(row["same_tokens"], bool)
        assert 1 < row["generated_tokens"] <= 16 and row["prompts"] == 1
        assert [p["name"] for p in row["per_prompt"]] == ["fix-bug" if row["task"] == "grounded" else "poem"]
        if row["decoding"] == "none":
            assert row["speedup"] == 1.0 and row["drafted_tokens"] == 0 and row["acceptance_rate"] is None
        elif row["drafted_tokens"]:
            assert 0 <= row["acceptance_rate"] <= 1 and row["accepted_tokens"] <= row["drafted_tokens"]
            assert row["verify_steps"] >= 1 and 1 <= row["mean_accepted_length"] <= 1 + row["options"].get("k", 4)
        else:
            assert row["acceptance_rate"] is None
    grounded = {row["config"]: row for row in result["rows"] if row["task"] == "grounded"}
    assert grounded["ngram"]["drafted_tokens"] > 0  # the answer copies from its prompt: lookups find drafts
    assert grounded["draft layers=10"]["drafted_tokens"] > 0  # a draft model always drafts (unless paused)


def test_prompts_ship_as_package_data():
    prompts = bench_prompts()
    assert 4 <= len(prompts["grounded"]) <= 6 and 4 <= len(prompts["chat"]) <= 6
    assert all(p["prompt"] and p["name"] for task in prompts.values() for p in task)


def test_config_specs():
    config = parse_config("ngram  k=8 min_n=1 adaptive=false")
    assert (config.label, config.decoding, config.options) == ("ngram k=8 min_n=1 adaptive=false", "ngram",
                                                               {"k": 8, "min_n": 1, "adaptive": False})
    assert parse_config("draft model=/models/small").options == {"model": "/models/small"}


@pytest.mark.parametrize("args, message", [
    (("--tasks", "grounded,poetry"), "unknown task 'poetry'"),
    (("--max-tokens", "0"), "--max-tokens must be >= 1"),
    (("--prompts", "0"), "--prompts must be >= 1"),
    (("--config", "medusa"), "decoding plugin 'medusa' is not installed"),
    (("--config", "ngram k=0"), "'k'"),
    (("--config", "ngram k"), "expected OPTION=VALUE"),
    (("--config", "draft"), "exactly one of model=PATH and layers=N"),
])
def test_bad_arguments_are_refused_before_loading(args, message, embedded_path, capsys, monkeypatch):
    from kvforge.app.bench import spec
    from kvforge.app.cli import main

    def load(*_):
        raise AssertionError("a model was loaded before the arguments were refused")

    monkeypatch.setattr(spec, "measure", load)  # in this process: no interpreter start per refusal
    assert main(["bench", "spec", *args]) == 2
    assert message in capsys.readouterr().err


def test_greedy_speculation_is_lossless_in_fp32(fp32_result):
    assert {row["config"] for row in fp32_result["rows"]} == set(FP32_CONFIGS)
    for row in fp32_result["rows"]:
        assert row["same_tokens"] is True, (row["config"], row["task"])
        assert all(p["same_tokens"] for p in row["per_prompt"])
