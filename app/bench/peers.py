"""`kvforge bench peers`: kvforge side by side with other CPU engines on the embedded model, in one run.

Engines, each in a process of its own, one after another (peer_worker.py): HF transformers in fp32 (the
reference every ratio is taken against), kvforge in fp32 and bf16 (and a 4-bit checkpoint with
--kvforge-4bit DIR), and, when their virtualenvs are found, vLLM CPU in bf16 and fp32 (on kvforge's
safetensors conversion of the embedded GGUF) and llama.cpp (llama-cpp-python on the embedded Q4_1 GGUF
itself). A peer that is not installed is reported as skipped, with why; an engine that fails is reported
with the tail of its stderr, and the others still run.

Every engine gets the same token ids (the chat prompts of workloads.chat_messages with kvforge's chat
template applied), greedy, forced to --output-tokens tokens (EOS ignored), prefix caching off. At batch B
an engine serves ceil(--prompts / B) * B requests in waves of B submitted at once. Per engine and batch:
output tok/s, TTFT and TPOT (p50 / p99 over the requests) where the engine lets us measure them ("-" where
not), and the ratios against HF fp32, vLLM bf16 and llama.cpp measured in the same run.

With --http the same engines run as OpenAI-compatible servers instead (HF has none): `kvforge serve` (API only,
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
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvforge.app.bench.arguments import int_list
from kvforge.app.bench.report import error_line, fmt, ms, percentile
from kvforge.app.bench.workloads import chat_messages
from kvforge.app.threaded_server import free_port

WORKER = Path(__file__).with_name("peer_worker.py")
STDERR_TAIL_LINES = 25


@dataclass(frozen=True)
class Engine:
    name: str
    kind: str  # the worker's runner: hf | kvforge | vllm | llama.cpp
    dtype: str
    peer: str | None = None  # vllm | llama: runs in that peer's interpreter


ENGINES = (
    Engine("hf-fp32", "hf", "float32"),
    Engine("kvforge-fp32", "kvforge", "float32"),
    Engine("kvforge-bf16", "kvforge", "bfloat16"),
    Engine("kvforge-4bit", "kvforge", "bfloat16"),
    Engine("vllm-bf16", "vllm", "bfloat16", peer="vllm"),
    Engine("vllm-fp32", "vllm", "float32", peer="vllm"),
    Engine("llama.cpp-q4_1", "llama.cpp", "q4_1", peer="llama"),
)
REFERENCES = {"vs_hf": "hf-fp32", "vs_vllm_bf16": "vllm-bf16", "vs_llama_cpp": "llama.cpp-q4_1"}
RATIO_TITLES = {"vs_hf": "vs HF", "vs_vllm_bf16": "vs vLLM bf16", "vs_llama_cpp": "vs llama.cpp"}
# --http: the server each kind of engine runs as (HF transformers has none)
SERVERS = {"kvforge": "kvforge serve", "vllm": "vllm serve", "llama.cpp": "python -m llama_cpp.server"}

# peer -> (the Python module it needs, the virtualenv under the peers dir, its flag, its environment variable)
PEERS = {"vllm": ("vllm", "vllm", "--vllm-python", "KVFORGE_VLLM_PYTHON"),
         "llama": ("llama_cpp", "llama", "--llama-python", "KVFORGE_LLAMA_PYTHON")}


@dataclass
class EngineRun:
    engine: Engine
    status: str = "ok"  # ok | skipped | failed
    why: str | None = None
    python: str | None = None
    seconds: float | None = None
    info: dict = field(default_factory=dict)
    measurements: list[dict] = field(default_factory=list)
    stderr_tail: str | None = None

    def summary(self) -> dict:
        return {"engine": self.engine.name, "kind": self.engine.kind, "dtype": self.engine.dtype,
                "status": self.status, "why": self.why, "python": self.python, "seconds": self.seconds,
                "info": self.info, "stderr_tail": self.stderr_tail,
                "skipped_batches": {str(m["batch"]): m["skipped"] for m in self.measurements if "skipped" in m}}


def default_peers_dir() -> Path:
    return Path(os.environ.get("KVFORGE_PEERS_DIR") or Path.home() / ".cache" / "kvforge-peers")


def find_peer(peer: str, args: argparse.Namespace, needs: tuple[str, ...] = ()) -> tuple[str | None, str | None]:
    """The peer's interpreter (flag > environment variable > the peers dir), or None and why it is skipped. The
    interpreter must find the peer's module and the modules in `needs`."""
    module, venv, flag, variable = PEERS[peer]
    if args.no_peers:
        return None, "--no-peers"
    given = getattr(args, f"{peer}_python") or os.environ.get(variable)
    if given:
        python, where = Path(given).expanduser(), f"{flag} / {variable}"
    else:
        python = Path(args.peers_dir or default_peers_dir()) / venv / "bin" / "python"
        where = f"the peers dir: --peers-dir / KVFORGE_PEERS_DIR, or {flag} / {variable}"
    if not python.exists():
        return None, f"not installed: no {python} ({where})"
    try:
        check = subprocess.run([str(python), "-c", "import importlib.util, sys\n"
                                f"for m in {(module, *needs)!r}:\n"
                                "    if importlib.util.find_spec(m) is None: print(m); sys.exit(3)"],
                               capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python} does not run: {exc}"
    if check.returncode == 3:
        return None, f"not installed: {python} has no {check.stdout.strip() or module} module"
    if check.returncode != 0:
        return None, f"{python} does not run: {_tail(check.stderr, 3) or f'exit code {check.returncode}'}"
    return str(python), None


def requests_per_batch(prompts: int, batches: list[int]) -> dict[int, int]:
    """Whole waves: at batch B, ceil(prompts / B) * B requests."""
    return {b: math.ceil(prompts / b) * b for b in batches}


def vllm_cpu_binding(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` threads on the CPUs this process may use (vLLM's "auto" keeps a
    core for its scheduler and one thread per physical core: on a small machine it would run on fewer threads
    than the other engines)."""
    return ",".join(str(c) for c in usable_cpus()[:threads])


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on (its affinity)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def run_engine(run: EngineRun, job: dict, workdir: Path, timeout: float, env: dict) -> EngineRun:
    """Run one engine's worker in a process (group) of its own; what it measured before a crash or a timeout
    is kept."""
    jobdir = Path(tempfile.mkdtemp(prefix=f"{run.engine.name}-", dir=workdir))
    worker = jobdir / "peer_worker.py"
    shutil.copyfile(WORKER, worker)  # run from its own directory: nothing of the package on the peer's sys.path
    out, err, log = jobdir / "rows.jsonl", jobdir / "stderr.txt", jobdir / "stdout.txt"
    (jobdir / "job.json").write_text(json.dumps({**job, "out": str(out)}))
    start = time.perf_counter()
    with open(err, "w") as stderr, open(log, "w") as stdout:
        proc = subprocess.Popen([run.python, str(worker), str(jobdir / "job.json")], cwd=jobdir, env=env,
                                stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop_group(proc)
    run.seconds = time.perf_counter() - start
    for line in out.read_text().splitlines() if out.exists() else []:
        row = json.loads(line)
        if "info" in row:
            run.info |= row["info"]
        else:
            run.measurements.append(row)
    if code != 0:
        run.status = "failed"
        run.why = f"stopped after {timeout:.0f} s (--timeout)" if code is None else f"exit code {code}"
        run.stderr_tail = _tail(err.read_text(errors="replace"), STDERR_TAIL_LINES)
    return run


def _stop_group(proc: subprocess.Popen) -> None:
    """The worker and whatever it started (vLLM's engine process)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def measurement_rows(runs: list[EngineRun], output_tokens: int, prompt_lens: list[int]) -> list[dict]:
    """One row per engine and batch measured, with the ratios against the reference engines' rows of the same
    batch in this run."""
    rows = []
    for run in runs:
        for m in run.measurements:
            if "skipped" in m:
                continue
            ttft, tpot = m.get("ttft_s"), m.get("tpot_s")
            rows.append({
                "engine": run.engine.name, "kind": run.engine.kind, "dtype": run.engine.dtype, "batch": m["batch"],
                "requests": m["requests"], "waves": m["requests"] // m["batch"], "output_tokens": output_tokens,
                "prompt_tokens": m["prompt_tokens"] if m.get("prompt_tokens") is not None
                else sum(prompt_lens[:m["requests"]]), "generated_tokens": m["generated_tokens"],
                "wall_s": m["wall_s"], "output_tok_s": m["generated_tokens"] / m["wall_s"],
                "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)} if ttft else None,
                "tpot_s": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)} if tpot else None,
                "timing": m.get("timing")})
    by_key = {(r["engine"], r["batch"]): r for r in rows}
    for r in rows:
        for key, ref_name in REFERENCES.items():
            ref = by_key.get((ref_name, r["batch"]))
            r[key] = r["output_tok_s"] / ref["output_tok_s"] if ref else None
    return rows


def print_report(report: dict) -> None:
    cpu, o, p = report["cpu"], report["options"], report["prompts"]
    http = o.get("http")
    if http:
        print(f"kvforge bench peers --http: {report['model']}; greedy, {o['output_tokens']} output tokens per "
              "request (EOS ignored), prefix caching off; each engine's OpenAI-compatible server a subprocess of "
              "its own, one after another, streamed chat requests")
    else:
        print(f"kvforge bench peers: {report['model']}; greedy, {o['output_tokens']} output tokens per request "
              f"(EOS ignored), prefix caching off; each engine in its own process, one after another")
    print(f"CPU: {cpu['model']} ({cpu['machine']}); ISA: {' '.join(cpu['isa']) or 'no AVX2'}; "
          f"{cpu['usable_cpus']} of {cpu['logical_cpus']} logical CPUs usable; {o['threads']} "
          f"thread{'s' if o['threads'] > 1 else ''} per engine"
          + (f" (vLLM bound to CPU ids {o['vllm_cpus']})" if o.get("vllm_cpus") else ""))
    if http:
        gen = o["load_generator"]
        print(f"load generator: {gen['description']}" + (f" ({gen['why']})" if gen.get("why") else ""))
    if http and p.get("source") == "random":
        print(f"prompts: random, {p['input_tokens']} tokens each (vllm bench serve --dataset-name random --seed "
              f"{p['seed']}: the same for every server; the server's chat template adds its own); at concurrency C "
              f"ceil({o['prompts']} / C) * C of them, at most C in flight")
    elif http:
        print(f"prompts: {p['count']} chat prompts, the same messages for every server ({p['min_tokens']}-"
              f"{p['max_tokens']} tokens with kvforge's chat template, mean {p['mean_tokens']:.0f}); at concurrency"
              f" C the first ceil({o['prompts']} / C) * C of them, at most C in flight")
    else:
        print(f"prompts: {p['count']} chat prompts, the same token ids for every engine ({p['min_tokens']}-"
              f"{p['max_tokens']} tokens, mean {p['mean_tokens']:.0f}); at batch B the first "
              f"ceil({o['prompts']} / B) * B of them, in waves of B submitted at once")
    print("engines:")
    for e in report["engines"]:
        line = f"  {e['engine']:<15} {e['status']:<8}"
        if e["status"] == "skipped":
            line += f" {e['why']}"
        else:
            line += f" {fmt(e['seconds'], '.0f')} s"
            line += (f" ({'up' if http else 'load'} {e['info']['load_s']:.0f} s)"
                     if e["info"].get("load_s") is not None else "")
            line += f"; {e['info']['library']}" if e["info"].get("library") else ""
            line += f"; {e['why']}" if e["why"] else ""
        print(line)
        for batch, why in e["skipped_batches"].items():
            print(f"  {'':<15} {'':<8} batch {batch} skipped: {why}")
    rows = report["rows"]
    level = "concurrency" if http else "batch"
    for batch in o["batches"]:
        here = [r for r in rows if r["batch"] == batch]
        requests = report["requests_per_batch"][str(batch)]
        if http:
            how = "one at a time" if batch == 1 else f"at most {batch} in flight"
        else:
            how = "one at a time" if batch == 1 else f"in waves of {batch} submitted at once"
        print(f"\n== {level} {batch}: {requests} requests {how} ==")
        if not here:
            print(f"(no engine measured this {level})")
            continue
        ratios = [k for k in REFERENCES if any(r[k] is not None for r in here)]
        header = (f"{'engine':<15} {'tok/s':>8} {'TTFT p50':>10} {'TPOT p50':>10}"
                  + "".join(f" {RATIO_TITLES[k]:>13}" for k in ratios))
        print(header)
        print("-" * len(header))
        for r in here:
            print(f"{r['engine']:<15} {r['output_tok_s']:>8.1f} {_ms(r['ttft_s']):>10} {_ms(r['tpot_s']):>10}"
                  + "".join(f" {fmt(r[k], '.2f', '-') + ('x' if r[k] is not None else ''):>13}" for k in ratios))
    timings = {}
    for r in rows:
        timings.setdefault(r["kind"], r["timing"])
    if http and rows:
        print(f"\nTTFT / TPOT in ms, p50 over the requests, measured by the load generator: {rows[0]['timing']}")
    elif timings:
        print("\nTTFT / TPOT in ms, p50 over the requests (\"-\": not measurable on that engine):")
        for kind, how in timings.items():
            print(f"  {kind}: {how}")
    failed = [e for e in report["engines"] if e["status"] == "failed"]
    for e in failed:
        print(f"\n{e['engine']} FAILED ({e['why']}); the tail of its stderr:")
        for line in (e["stderr_tail"] or "(empty)").splitlines():
            print(f"  | {line}")


def _ms(stat: dict | None) -> str:
    return "-" if not stat or stat.get("p50") is None else ms(stat["p50"])


def _selected(args: argparse.Namespace) -> list[Engine]:
    names = [e.name for e in ENGINES]
    kinds = {e.name: e.kind for e in ENGINES}
    if args.engines:
        wanted = [n.strip() for n in args.engines.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise ValueError(f"--engines: unknown engine {unknown[0]!r} (choose from {', '.join(names)})")
        if "kvforge-4bit" in wanted and not args.kvforge_4bit:
            raise ValueError("--engines kvforge-4bit needs --kvforge-4bit DIR (a 4-bit GPTQ / AWQ checkpoint)")
    else:
        wanted = [n for n in names if (n != "kvforge-4bit" or args.kvforge_4bit)
                  and (not args.http or kinds[n] in SERVERS)]
    if args.http:
        serverless = [n for n in wanted if kinds[n] not in SERVERS]
        if serverless:
            raise ValueError(f"--engines {serverless[0]}: no server to run with --http")
    return [e for e in ENGINES if e.name in wanted]


# --- --http: each engine's OpenAI-compatible server under a load generator ---------------------------------------

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


def wait_until_serving(proc: subprocess.Popen, url: str, deadline: float, log: Path) -> None:
    """Until GET /v1/models answers 200 (the model is loaded); the server's exit or the deadline fail the engine."""
    import httpx

    while True:
        if proc.poll() is not None:
            raise HttpFailure(f"the server exited (code {proc.returncode}) before it answered")
        if time.monotonic() > deadline:
            raise HttpFailure("the server did not answer /v1/models before --timeout")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


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
    _stop_group(proc)
    return how


async def _stream_chat(client, messages: list[dict], tokens: int, extra: dict) -> dict:
    """One streamed chat request; its TTFT at the first chunk with content, TPOT (last - first content chunk) /
    (tokens - 1), the token counts from the usage chunk."""
    payload = {"model": SERVED_NAME, "messages": messages, "max_tokens": tokens, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}
    start, times, usage = time.perf_counter(), [], {}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise HttpFailure(f"HTTP {response.status_code}: {body[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise HttpFailure(f"stream error: {chunk['error']}")
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    if not times:
        raise HttpFailure("a stream ended without content")
    n = usage.get("completion_tokens", len(times))
    return {"tokens": n, "prompt_tokens": usage.get("prompt_tokens"), "ttft": times[0] - start,
            "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 and len(times) > 1 else None}


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
                                "ttft_s": _all_or_none(ttft), "tpot_s": _all_or_none(tpot),
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
            _stop_group(proc)
    if code != 0 or not result.exists():
        why = "stopped at --timeout" if code is None else f"exit code {code}"
        raise HttpFailure(f"vllm bench serve at concurrency {batch}: {why}",
                          _tail(log.read_text(errors="replace"), STDERR_TAIL_LINES))
    return vllm_bench_measurement(json.loads(result.read_text()), batch, requests, a.output_tokens)


def client_measurement(setup: HttpSetup, engine: Engine, url: str, batch: int, deadline: float) -> dict:
    tokens = setup.args.output_tokens
    results, wall = asyncio.run(client_level(url, setup.messages[:setup.requests[batch]], batch, tokens,
                                             extra_body(engine, tokens), max(1.0, deadline - time.monotonic())))
    prompt_tokens = [r["prompt_tokens"] for r in results]
    return checked_measurement({"batch": batch, "requests": len(results),
                                "generated_tokens": sum(r["tokens"] for r in results), "wall_s": wall,
                                "ttft_s": [r["ttft"] for r in results],
                                "tpot_s": _all_or_none([r["tpot"] for r in results]),
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
        wait_until_serving(proc, url, deadline, log)
        run.info["load_s"] = time.perf_counter() - start
        tokens = setup.args.output_tokens
        asyncio.run(client_level(url, [WARM_UP], 1, 2, extra_body(engine, 2), max(1.0, deadline - time.monotonic())))
        for batch in setup.levels:
            if setup.generator.kind == "vllm":
                m = vllm_bench_level(setup, engine, url, batch, jobdir, deadline)
            else:
                m = client_measurement(setup, engine, url, batch, deadline)
            run.measurements.append(m)
            _say(f"{engine.name}: concurrency {batch}: {m['generated_tokens'] / m['wall_s']:.1f} tok/s "
                 f"({m['requests']} x {tokens} tokens)")
            if time.monotonic() > deadline:
                raise HttpFailure(f"stopped after {setup.args.timeout:.0f} s (--timeout)")
    except Exception as exc:  # noqa: BLE001 (the engine fails, the others still run)
        run.status = "failed"
        run.why = str(exc) if isinstance(exc, HttpFailure) else error_line(exc)
        if isinstance(exc, TimeoutError):
            run.why = f"stopped after {setup.args.timeout:.0f} s (--timeout)"
        tail = getattr(exc, "tail", None)
        server = _tail(log.read_text(errors="replace"), STDERR_TAIL_LINES) if log.exists() else ""
        run.stderr_tail = tail or server or None
    finally:
        if proc is not None:
            run.info["stop"] = stop_server(proc)
        run.seconds = time.perf_counter() - start
    return run


def _all_or_none(values: list) -> list | None:
    known = [v for v in values if v is not None]
    return known if len(known) == len(values) and known else None  # no partial percentiles


# --- the command ------------------------------------------------------------------------------------------------

def run_peers(args: argparse.Namespace) -> int:
    from kvforge.core.cpu import cpu_model_and_flags, isa
    from kvforge.core.loader import EMBEDDED_MODEL, embedded_gguf_path, resolve_model
    from kvforge.core.tokenizer import Tokenizer

    if args.http and args.batches is not None:
        raise ValueError("--batches is for the offline engines: with --http use --concurrency")
    if not args.http and args.concurrency is not None:
        raise ValueError("--concurrency is for --http (the offline engines take --batches)")
    batches = (int_list(args.concurrency or "1,16,64", "concurrency") if args.http
               else int_list(args.batches or "1,16,64", "batches"))
    for name in ("prompts", "output_tokens", "threads", "input_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    engines = _selected(args)
    quantized = str(resolve_model(args.kvforge_4bit)) if args.kvforge_4bit else None
    model_dir, gguf = resolve_model(None), embedded_gguf_path()  # vLLM reads kvforge's conversion of the GGUF
    threads = args.threads or len(usable_cpus())
    requests = requests_per_batch(args.prompts, batches)
    tokenizer = Tokenizer(model_dir)
    messages = chat_messages(max(requests.values()))
    prompts = [tokenizer.apply_chat_template(m) for m in messages]
    lengths = [len(ids) for ids in prompts]
    hf_tok = tokenizer.hf
    pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id

    cpu_model, _ = cpu_model_and_flags()
    cpu = {"model": cpu_model, "machine": os.uname().machine, "isa": isa(), "logical_cpus": os.cpu_count(),
           "usable_cpus": len(usable_cpus()), "threads": threads}
    vllm_cpus = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or vllm_cpu_binding(threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1",
               VLLM_CPU_OMP_THREADS_BIND=vllm_cpus, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    models = {e.name: {"vllm": str(model_dir), "llama.cpp": str(gguf)}.get(e.kind, str(model_dir)) for e in ENGINES}
    if quantized:
        models["kvforge-4bit"] = quantized

    setup, needs = None, {}  # needs: the modules a peer's server needs besides the peer's own
    if args.http:
        needs = {"llama": LLAMA_SERVER_MODULES}
        generator = choose_load_generator(args)
        longest = max(max(lengths), args.input_tokens + 64)  # + the chat template around a random prompt
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(args.kv_cache_gb))))
        setup = HttpSetup(args, batches, requests, messages, generator, {**models, "tokenizer": str(model_dir)},
                          threads, max(2048, longest + args.output_tokens + 16), env)
        _say(f"load generator: {generator.description}" + (f" ({generator.why})" if generator.why else ""))
    common = {"prompts": prompts, "batches": batches, "requests": {str(b): n for b, n in requests.items()},
              "output_tokens": args.output_tokens, "threads": threads, "kv_cache_gib": args.kv_cache_gb,
              "pad_id": pad}

    runs = []
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-peers-") as tmp:
        for engine in engines:
            run = EngineRun(engine)
            runs.append(run)
            if engine.peer:
                run.python, why = find_peer(engine.peer, args, needs.get(engine.peer, ()))
                if why:
                    run.status, run.why = "skipped", why
                    _say(f"{engine.name}: skipped ({why})")
                    continue
            else:
                run.python = sys.executable
            _say(f"{engine.name}: running ({run.python})")
            if setup:
                run_http_engine(run, setup, Path(tmp))
            else:
                run_engine(run, {**common, "kind": engine.kind, "model": models[engine.name], "dtype": engine.dtype},
                           Path(tmp), args.timeout, env)
            _say(f"{engine.name}: {run.status} in {run.seconds:.0f} s" + (f" ({run.why})" if run.why else ""))

    options = {"batches": batches, "prompts": args.prompts, "output_tokens": args.output_tokens, "threads": threads,
               "kv_cache_gb": args.kv_cache_gb,
               "vllm_cpus": vllm_cpus if any(r.engine.kind == "vllm" and r.status != "skipped" for r in runs) else None}
    prompt_info = {"count": len(prompts), "min_tokens": min(lengths), "max_tokens": max(lengths),
                   "mean_tokens": sum(lengths) / len(lengths)}
    if setup:
        gen = setup.generator
        options |= {"http": True, "concurrency": batches, "load_generator": {"kind": gen.kind,
                    "description": gen.description, "why": gen.why}}
        if gen.kind == "vllm":
            options |= {"input_tokens": args.input_tokens, "seed": args.seed}
            prompt_info = {"source": "random", "input_tokens": args.input_tokens, "seed": args.seed}
        else:
            prompt_info["source"] = "chat"
    report = {"command": "kvforge bench peers" + (" --http" if setup else ""),
              "model": f"{EMBEDDED_MODEL} (the embedded model)", "cpu": cpu, "options": options,
              "prompts": prompt_info, "requests_per_batch": {str(b): n for b, n in requests.items()},
              "engines": [r.summary() for r in runs],
              "rows": measurement_rows(runs, args.output_tokens, lengths)}
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if any(r.status == "failed" for r in runs) else 0


def _say(text: str) -> None:
    print(f"[bench peers] {text}", file=sys.stderr, flush=True)


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `peers` on the `kvforge bench` subcommands."""
    peers = bench_sub.add_parser(
        "peers", help="kvforge side by side with HF transformers, vLLM CPU and llama.cpp (when installed), "
                      "each in its own process, same prompts and token counts (--http: their servers under load)")
    peers.add_argument("--engines", default=None,
                       help=f"comma-separated, from {', '.join(e.name for e in ENGINES)} (default: all; "
                            "kvforge-4bit only with --kvforge-4bit; hf-fp32 not with --http; a peer that is not "
                            "installed is skipped)")
    peers.add_argument("--batches", default=None, help="requests submitted at once (default: 1,16,64)")
    peers.add_argument("--prompts", type=int, default=16,
                       help="chat prompts per batch: at batch B, ceil(N / B) * B requests (default: 16)")
    peers.add_argument("--output-tokens", type=int, default=128, help="tokens per request, EOS ignored (default: 128)")
    peers.add_argument("--threads", type=int, default=None, help="CPU threads per engine (default: the usable CPUs)")
    peers.add_argument("--kv-cache-gb", type=float, default=2.0,
                       help="KV cache of kvforge and vLLM (VLLM_CPU_KVCACHE_SPACE) in GiB (default: 2)")
    peers.add_argument("--kvforge-4bit", default=None, metavar="DIR",
                       help="also kvforge on this 4-bit GPTQ / AWQ checkpoint in bf16 (e.g. from `kvforge quantize`)")
    peers.add_argument("--peers-dir", default=None,
                       help="where the peers' virtualenvs are: vllm/ and llama/ (default: $KVFORGE_PEERS_DIR or "
                            "~/.cache/kvforge-peers)")
    peers.add_argument("--vllm-python", default=None,
                       help="the interpreter that has vLLM CPU (default: $KVFORGE_VLLM_PYTHON or the peers dir's)")
    peers.add_argument("--llama-python", default=None,
                       help="the interpreter that has llama-cpp-python (default: $KVFORGE_LLAMA_PYTHON or the "
                            "peers dir's)")
    peers.add_argument("--no-peers", action="store_true", help="HF and kvforge only: skip vLLM and llama.cpp")
    peers.add_argument("--timeout", type=float, default=1800,
                       help="seconds per engine (--http: its server's start and every level) (default: 1800)")
    peers.add_argument("--json", default=None, metavar="PATH", help="also write the whole report as JSON")
    http = peers.add_argument_group("--http: each engine's OpenAI-compatible server under a load generator")
    http.add_argument("--http", action="store_true",
                      help="run kvforge serve, vllm serve and llama-cpp-python's server (when installed) one after "
                           "another and drive each at every --concurrency with the same streamed chat requests")
    http.add_argument("--concurrency", default=None,
                      help="requests in flight at once (default: 1,16,64); at C, ceil(--prompts / C) * C requests")
    http.add_argument("--load-generator", choices=("auto", "vllm", "kvforge"), default="auto",
                      help="vllm: `vllm bench serve` from vLLM's virtualenv on random prompts; kvforge: our own "
                           "httpx client on the chat prompts; auto (default): vLLM's when it is installed")
    http.add_argument("--input-tokens", type=int, default=128,
                      help="vllm bench serve's random prompt length in tokens (default: 128)")
    http.add_argument("--seed", type=int, default=0,
                      help="vllm bench serve's seed, the same for every server: the same prompts (default: 0)")
    peers.set_defaults(func=run_peers)
    return peers
