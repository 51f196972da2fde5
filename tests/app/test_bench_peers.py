"""`kvforge bench peers`, run as a real subprocess on the embedded model with HF and kvforge only (tiny sizes, no
timing assertions: the table, the JSON rows and the arithmetic that ties them together). The peers (vLLM,
llama.cpp) are not part of CI: here they are pointed at paths that do not exist and must be reported as skipped;
an engine that fails is driven with a stand-in interpreter."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

OUTPUT_TOKENS, PROMPTS, BATCHES = 4, 2, (1, 2)


@pytest.fixture(scope="module")
def run(embedded_path, tmp_path_factory):
    """The GGUF conversion happens (through embedded_path) before the subprocess starts."""
    tmp = tmp_path_factory.mktemp("bench-peers")
    out = tmp / "peers.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", KVFORGE_PEERS_DIR=str(tmp / "no-peers-here"))
    env.pop("KVFORGE_VLLM_PYTHON", None)
    env.pop("KVFORGE_LLAMA_PYTHON", None)
    # one thread: on a busy machine a second one stalls every OpenMP barrier while it waits for a core
    result = subprocess.run(
        [sys.executable, "-m", "kvforge.app.cli", "bench", "peers", "--engines",
         "hf-fp32,kvforge-fp32,vllm-bf16,llama.cpp-q4_1", "--vllm-python", str(tmp / "missing" / "python"),
         "--prompts", str(PROMPTS), "--batches", ",".join(map(str, BATCHES)), "--output-tokens", str(OUTPUT_TOKENS),
         "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, json.loads(out.read_text())


def test_table_names_the_cpu_and_every_engine_per_batch(run):
    stdout, _ = run
    assert "CPU: " in stdout and "ISA: " in stdout and "1 thread per engine" in stdout
    for batch in BATCHES:
        table = stdout.split(f"== batch {batch}:")[1].split("\n\n")[0]
        assert "tok/s" in table and "TTFT p50" in table and "vs HF" in table
        assert "vs vLLM bf16" not in table  # no vLLM row in this run: no such column
        for engine in ("hf-fp32", "kvforge-fp32"):
            assert any(line.startswith(engine) for line in table.splitlines()), table


def test_missing_peers_are_skipped_with_why(run):
    stdout, report = run
    engines = {e["engine"]: e for e in report["engines"]}
    for name in ("vllm-bf16", "llama.cpp-q4_1"):
        assert engines[name]["status"] == "skipped"
        assert engines[name]["why"].startswith("not installed: no ")
        assert any(line.split()[:2] == [name, "skipped"] for line in stdout.splitlines())
    assert "missing" in engines["vllm-bf16"]["why"] and "no-peers-here" in engines["llama.cpp-q4_1"]["why"]
    assert engines["hf-fp32"]["status"] == engines["kvforge-fp32"]["status"] == "ok"
    assert not any(r["engine"].startswith(("vllm", "llama")) for r in report["rows"])


def test_rows_are_sane_and_ratios_come_from_the_same_run(run):
    _, report = run
    rows = {(r["engine"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {(e, b) for e in ("hf-fp32", "kvforge-fp32") for b in BATCHES}
    assert report["options"]["batches"] == list(BATCHES) and report["options"]["output_tokens"] == OUTPUT_TOKENS
    for (_, batch), r in rows.items():
        assert r["requests"] == PROMPTS and r["waves"] == PROMPTS // batch
        assert r["generated_tokens"] == PROMPTS * OUTPUT_TOKENS
        assert r["wall_s"] > 0 and r["output_tok_s"] > 0
        assert r["output_tok_s"] == pytest.approx(r["generated_tokens"] / r["wall_s"])
        hf = rows[("hf-fp32", batch)]
        assert r["vs_hf"] == pytest.approx(r["output_tok_s"] / hf["output_tok_s"])
        assert r["vs_vllm_bf16"] is None and r["vs_llama_cpp"] is None
        assert r["ttft_s"]["p50"] > 0 and r["ttft_s"]["p50"] <= r["ttft_s"]["p99"]
    assert rows[("hf-fp32", 1)]["vs_hf"] == pytest.approx(1.0)
    assert all(rows[("kvforge-fp32", b)]["tpot_s"]["p50"] > 0 for b in BATCHES)


def test_a_failing_engine_is_reported_with_its_stderr_and_keeps_what_it_measured(tmp_path):
    from kvforge.app.bench.peers import ENGINES, EngineRun, run_engine

    fake = tmp_path / "python"  # an "interpreter" that measures one batch, then crashes
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""
        import json, sys
        job = json.load(open(sys.argv[2]))
        with open(job["out"], "a") as f:
            f.write(json.dumps({"info": {"library": "fake 1.0"}}) + "\\n")
            f.write(json.dumps({"batch": 1, "requests": 1, "generated_tokens": 4, "wall_s": 0.5,
                                "ttft_s": None, "tpot_s": None, "timing": "none"}) + "\\n")
        print("Traceback: the peer fell over", file=sys.stderr)
        sys.exit(3)
    """))
    fake.chmod(0o755)
    run = EngineRun(next(e for e in ENGINES if e.name == "llama.cpp-q4_1"), python=str(fake))
    run_engine(run, {"kind": "llama.cpp"}, tmp_path, timeout=60, env=dict(os.environ))
    assert run.status == "failed" and run.why == "exit code 3"
    assert "the peer fell over" in run.stderr_tail
    assert run.info == {"library": "fake 1.0"} and run.measurements[0]["generated_tokens"] == 4


def test_a_peer_without_its_module_is_skipped(tmp_path, monkeypatch):
    from kvforge.app.bench.peers import find_peer

    monkeypatch.delenv("KVFORGE_LLAMA_PYTHON", raising=False)
    args = argparse.Namespace(no_peers=False, vllm_python=sys.executable, llama_python=None,
                              peers_dir=str(tmp_path))
    python, why = find_peer("vllm", args)  # this interpreter has no vLLM
    assert python is None and why == f"not installed: {sys.executable} has no vllm module"
    python, why = find_peer("llama", args)
    assert python is None and why.startswith(f"not installed: no {tmp_path}")
    assert find_peer("vllm", argparse.Namespace(**{**vars(args), "no_peers": True})) == (None, "--no-peers")
