"""`kvforge bench peers`, run as a real subprocess on the embedded model with HF and kvforge only (tiny sizes, no
timing assertions: the table, the JSON rows and the arithmetic that ties them together). The peers (vLLM,
llama.cpp) are not part of CI: here they are pointed at paths that do not exist and must be reported as skipped;
an engine that fails is driven with a stand-in interpreter. --http runs kvforge's own server under our httpx client
(vLLM forced off, so its `vllm bench serve` is not the load generator); the parsing of `vllm bench serve`'s result
file and the stopping of a server's process group are checked on stand-ins."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

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
         "hf-fp32,kvforge-fp32,vllm-bf16,llama.cpp", "--vllm-python", str(tmp / "missing" / "python"),
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
    for name in ("vllm-bf16", "llama.cpp"):
        assert engines[name]["status"] == "skipped"
        assert engines[name]["why"].startswith("not installed: no ")
        assert any(line.split()[:2] == [name, "skipped"] for line in stdout.splitlines())
    assert "missing" in engines["vllm-bf16"]["why"] and "no-peers-here" in engines["llama.cpp"]["why"]
    assert engines["llama.cpp"]["dtype"] == "q4_1"  # the embedded GGUF's file type, read from the file
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


@pytest.fixture(scope="module")
def gguf_run(tmp_path_factory):
    """--gguf on the tiny shape's Q4_K_M file, in 2 --rounds (what test_rounds_run_every_engine_in_turn reads: the
    two engines take turns): stdout, the JSON report and the file."""
    from kvforge.app.bench.real_shapes import shape_gguf

    tmp = tmp_path_factory.mktemp("bench-peers-gguf")
    gguf_path = shape_gguf("tiny", "q4_k_m", root=tmp)
    out = tmp / "other.json"
    result = subprocess.run(
        [sys.executable, "-m", "kvforge.app.cli", "bench", "peers", "--gguf", str(gguf_path), "--engines",
         "kvforge-gguf,llama.cpp", "--no-peers", "--rounds", "2", "--prompts", "1", "--batches", "1",
         "--output-tokens", str(OUTPUT_TOKENS), "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, json.loads(out.read_text()), gguf_path


def test_gguf_runs_the_same_comparison_on_another_file(gguf_run, tmp_path, capsys):
    """--gguf: kvforge-gguf serves that file (the tiny shape in Q4_K_M, app/bench/real_shapes.py: a file other than
    the embedded model, of another quantization) from its blocks, the report names it, and llama.cpp's quantization
    is the file's, not the embedded model's (Q4_1)."""
    stdout, report, gguf_path = gguf_run
    assert report["model"] == str(gguf_path.resolve()) and f"peers: {report['model']};" in stdout
    engines = {e["engine"]: e for e in report["engines"]}
    assert engines["kvforge-gguf"]["status"] == "ok"
    info = engines["kvforge-gguf"]["info"]
    assert 0 < info["load_s"] < info["ready_s"]  # the model's load; from the worker's start (imports too)
    assert engines["llama.cpp"]["status"] == "skipped" and engines["llama.cpp"]["dtype"] == "q4_k_m"
    (row,) = report["rows"]
    assert row["engine"] == "kvforge-gguf" and row["generated_tokens"] == OUTPUT_TOKENS and row["output_tok_s"] > 0
    from kvforge.app.cli import main

    assert main(["bench", "peers", "--gguf", str(tmp_path / "missing.gguf")]) == 2  # refused in this process
    assert "missing.gguf: not a .gguf file" in capsys.readouterr().err


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
    run = EngineRun(next(e for e in ENGINES if e.name == "llama.cpp"), python=str(fake))
    run_engine(run, {"kind": "llama.cpp"}, tmp_path, timeout=60, env=dict(os.environ))
    assert run.status == "failed" and run.why == "exit code 3"
    assert "the peer fell over" in run.stderr_tail
    assert run.info == {"library": "fake 1.0"} and run.measurements[0]["generated_tokens"] == 4


def test_a_peer_without_its_module_is_skipped(tmp_path, monkeypatch):
    from kvforge.app.bench.peer_engines import find_peer

    monkeypatch.delenv("KVFORGE_LLAMA_PYTHON", raising=False)
    args = argparse.Namespace(no_peers=False, vllm_python=sys.executable, llama_python=None,
                              peers_dir=str(tmp_path))
    python, why = find_peer("vllm", args)  # this interpreter has no vLLM
    assert python is None and why == f"not installed: {sys.executable} has no vllm module"
    python, why = find_peer("llama", args)
    assert python is None and why.startswith(f"not installed: no {tmp_path}")
    assert find_peer("vllm", argparse.Namespace(**{**vars(args), "no_peers": True})) == (None, "--no-peers")


@pytest.fixture(scope="module")
def http_run(embedded_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-peers-http")
    out = tmp / "peers-http.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "kvforge.app.cli", "bench", "peers", "--http", "--no-peers", "--engines",
         "kvforge-fp32,vllm-bf16", "--prompts", str(PROMPTS), "--concurrency", ",".join(map(str, BATCHES)),
         "--output-tokens", str(OUTPUT_TOKENS), "--threads", "1", "--timeout", "300", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, json.loads(out.read_text())


def test_http_serves_kvforge_under_our_client_and_fills_the_same_rows(http_run):
    stdout, report = http_run
    assert report["command"] == "kvforge bench peers --http"
    assert report["options"]["http"] and report["options"]["concurrency"] == list(BATCHES)
    assert report["options"]["load_generator"]["kind"] == "kvforge" and report["prompts"]["source"] == "chat"
    assert "load generator: kvforge's streaming httpx client (vllm bench serve: --no-peers)" in stdout
    engines = {e["engine"]: e for e in report["engines"]}
    assert set(engines) == {"kvforge-fp32", "vllm-bf16"}
    assert engines["vllm-bf16"]["status"] == "skipped" and engines["vllm-bf16"]["why"] == "--no-peers"
    kvforge = engines["kvforge-fp32"]
    assert kvforge["status"] == "ok" and kvforge["info"]["stop"] == "stopped" and kvforge["info"]["load_s"] > 0
    assert "kvforge serve" in kvforge["info"]["library"]
    rows = {r["batch"]: r for r in report["rows"]}
    assert set(rows) == set(BATCHES) and all(r["engine"] == "kvforge-fp32" for r in report["rows"])
    for batch, r in rows.items():
        assert r["requests"] == PROMPTS and r["generated_tokens"] == PROMPTS * OUTPUT_TOKENS
        assert r["output_tok_s"] == pytest.approx(r["generated_tokens"] / r["wall_s"])
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and r["tpot_s"]["p50"] > 0
        assert r["prompt_tokens"] > 0  # as the server counted them (usage)
        assert r["vs_hf"] is None and r["vs_vllm_bf16"] is None
        table = stdout.split(f"== concurrency {batch}:")[1].split("\n\n")[0]
        assert "TTFT p50" in table and any(line.startswith("kvforge-fp32") for line in table.splitlines())


def test_http_refuses_an_engine_without_a_server():
    from kvforge.app.bench.peers import _selected

    args = argparse.Namespace(engines="hf-fp32,kvforge-bf16", kvforge_4bit=None, http=True)
    with pytest.raises(ValueError, match="hf-fp32: no server"):
        _selected(args)
    assert "hf-fp32" not in [e.name for e in _selected(argparse.Namespace(**{**vars(args), "engines": None}))]


def _vllm_result(requests: int, tokens: int, **changes) -> dict:
    """What `vllm bench serve --save-result --save-detailed` writes, the fields the bench reads."""
    return {"duration": 2.0, "completed": requests, "failed": 0, "total_input_tokens": 130 * requests,
            "total_output_tokens": requests * tokens, "ttfts": [0.1 * (i + 1) for i in range(requests)],
            "latencies": [0.1 * (i + 1) + 0.05 * (tokens - 1) for i in range(requests)],
            "output_lens": [tokens] * requests, "errors": [""] * requests, **changes}


def test_a_vllm_bench_result_becomes_a_row_with_ratios_against_vllm_bf16():
    from kvforge.app.bench.peer_engines import ENGINES, EngineRun
    from kvforge.app.bench.peers_http import vllm_bench_measurement
    from kvforge.app.bench.peers_report import measurement_rows

    engines = {e.name: e for e in ENGINES}
    vllm = EngineRun(engines["vllm-bf16"], measurements=[vllm_bench_measurement(_vllm_result(4, 8), 2, 4, 8)])
    ours = EngineRun(engines["kvforge-bf16"], measurements=[vllm_bench_measurement(
        _vllm_result(4, 8, duration=1.0), 2, 4, 8)])
    rows = {r["engine"]: r for r in measurement_rows([vllm, ours], 8, [])}
    assert rows["vllm-bf16"]["output_tok_s"] == pytest.approx(16.0) and rows["kvforge-bf16"]["vs_vllm_bf16"] == 2.0
    assert rows["vllm-bf16"]["prompt_tokens"] == 520 and rows["vllm-bf16"]["waves"] == 2
    assert rows["vllm-bf16"]["ttft_s"]["p50"] == pytest.approx(0.25)
    assert rows["vllm-bf16"]["tpot_s"]["p50"] == pytest.approx(0.05)


def test_a_vllm_bench_result_with_failed_or_short_requests_is_refused():
    from kvforge.app.bench.peers_http import HttpFailure, vllm_bench_measurement

    failed = _vllm_result(4, 8, completed=3, failed=1, errors=["", "Traceback ...\nConnectionResetError: gone", "", ""])
    with pytest.raises(HttpFailure, match="3 of 4 requests completed; first error: ConnectionResetError: gone"):
        vllm_bench_measurement(failed, 2, 4, 8)
    with pytest.raises(HttpFailure, match="31 tokens generated, 32 expected"):
        vllm_bench_measurement(_vllm_result(4, 8, total_output_tokens=31), 2, 4, 8)


def test_a_server_that_ignores_sigterm_is_killed_with_its_whole_group(tmp_path):
    from kvforge.app.bench.peers_http import stop_server

    child_pid = tmp_path / "child.pid"
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        open({str(child_pid)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (child_pid.exists() and child_pid.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(child_pid.read_text())
    assert stop_server(server, grace=1) == "killed (no exit 1 s after SIGTERM)"
    assert server.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:  # killed, then reaped by init
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_rounds_report_medians_and_every_rounds_own_ratio(run):
    """--rounds: per engine and batch the median tok/s, TTFT and TPOT over the rounds, each ratio the median of
    the rounds' own same-run ratios (not a ratio of medians), and every round's figures kept."""
    from kvforge.app.bench.peers_report import median_rows

    _, report = run
    first = report["rows"]
    rounds = [first] + [[dict(r, output_tok_s=r["output_tok_s"] * scale, wall_s=r["wall_s"] / scale,
                              vs_hf=r["vs_hf"] * (scale if r["engine"] == "kvforge-fp32" else 1))
                         for r in first] for scale in (2.0, 0.5)]
    merged = {(r["engine"], r["batch"]): r for r in median_rows(rounds)}
    assert set(merged) == {(r["engine"], r["batch"]) for r in first}
    for r in first:
        m = merged[(r["engine"], r["batch"])]
        assert m["rounds_tok_s"] == pytest.approx([r["output_tok_s"] * s for s in (1.0, 2.0, 0.5)])
        assert m["output_tok_s"] == pytest.approx(r["output_tok_s"])  # the middle one
        assert m["rounds_vs_hf"] == pytest.approx([r["vs_hf"] * (s if r["engine"] == "kvforge-fp32" else 1)
                                                   for s in (1.0, 2.0, 0.5)])
        assert m["vs_hf"] == pytest.approx(r["vs_hf"]) and m["rounds_vs_vllm_bf16"] == []
        assert m["ttft_s"] == pytest.approx(r["ttft_s"])
    assert median_rows([first]) is first


def test_rounds_run_every_engine_in_turn(gguf_run, capsys):
    """--rounds 2 (gguf_run's): every engine once a round, in the same order, the row the median of the rounds."""
    stdout, report, _ = gguf_run
    assert [(e["engine"], e["round"], e["status"]) for e in report["engines"]] == [
        ("kvforge-gguf", 1, "ok"), ("llama.cpp", 1, "skipped"), ("kvforge-gguf", 2, "ok"), ("llama.cpp", 2, "skipped")]
    (row,) = report["rows"]
    assert len(row["rounds_tok_s"]) == 2 and min(row["rounds_tok_s"]) <= row["output_tok_s"] <= max(row["rounds_tok_s"])
    assert "medians of 2 rounds" in stdout and "kvforge-gguf #2" in stdout
    from kvforge.app.cli import main

    assert main(["bench", "peers", "--rounds", "0"]) == 2  # refused in this process
    assert "--rounds must be >= 1" in capsys.readouterr().err
