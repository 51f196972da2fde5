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
"""

from __future__ import annotations

import argparse
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
from kvforge.app.bench.report import fmt, ms, percentile
from kvforge.app.bench.workloads import chat_messages

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


def find_peer(peer: str, args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The peer's interpreter (flag > environment variable > the peers dir), or None and why it is skipped."""
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
        check = subprocess.run([str(python), "-c", "import importlib.util, sys; "
                                f"sys.exit(0 if importlib.util.find_spec({module!r}) else 3)"],
                               capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python} does not run: {exc}"
    if check.returncode == 3:
        return None, f"not installed: {python} has no {module} module"
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
                "prompt_tokens": sum(prompt_lens[:m["requests"]]), "generated_tokens": m["generated_tokens"],
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
    print(f"kvforge bench peers: {report['model']}; greedy, {o['output_tokens']} output tokens per request "
          f"(EOS ignored), prefix caching off; each engine in its own process, one after another")
    print(f"CPU: {cpu['model']} ({cpu['machine']}); ISA: {' '.join(cpu['isa']) or 'no AVX2'}; "
          f"{cpu['usable_cpus']} of {cpu['logical_cpus']} logical CPUs usable; {o['threads']} "
          f"thread{'s' if o['threads'] > 1 else ''} per engine"
          + (f" (vLLM bound to CPU ids {o['vllm_cpus']})" if o.get("vllm_cpus") else ""))
    print(f"prompts: {p['count']} chat prompts, the same token ids for every engine ({p['min_tokens']}-"
          f"{p['max_tokens']} tokens, mean {p['mean_tokens']:.0f}); at batch B the first ceil({o['prompts']} / B)"
          f" * B of them, in waves of B submitted at once")
    print("engines:")
    for e in report["engines"]:
        line = f"  {e['engine']:<15} {e['status']:<8}"
        if e["status"] == "skipped":
            line += f" {e['why']}"
        else:
            line += f" {fmt(e['seconds'], '.0f')} s"
            line += f" (load {e['info']['load_s']:.0f} s)" if e["info"].get("load_s") is not None else ""
            line += f"; {e['info']['library']}" if e["info"].get("library") else ""
            line += f"; {e['why']}" if e["why"] else ""
        print(line)
        for batch, why in e["skipped_batches"].items():
            print(f"  {'':<15} {'':<8} batch {batch} skipped: {why}")
    rows = report["rows"]
    for batch in o["batches"]:
        here = [r for r in rows if r["batch"] == batch]
        requests = report["requests_per_batch"][str(batch)]
        how = "one at a time" if batch == 1 else f"in waves of {batch} submitted at once"
        print(f"\n== batch {batch}: {requests} requests {how} ==")
        if not here:
            print("(no engine measured this batch)")
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
    if timings:
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
    if args.engines:
        wanted = [n.strip() for n in args.engines.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise ValueError(f"--engines: unknown engine {unknown[0]!r} (choose from {', '.join(names)})")
        if "kvforge-4bit" in wanted and not args.kvforge_4bit:
            raise ValueError("--engines kvforge-4bit needs --kvforge-4bit DIR (a 4-bit GPTQ / AWQ checkpoint)")
    else:
        wanted = [n for n in names if n != "kvforge-4bit" or args.kvforge_4bit]
    return [e for e in ENGINES if e.name in wanted]


def run_peers(args: argparse.Namespace) -> int:
    from kvforge.core.cpu import cpu_model_and_flags, isa
    from kvforge.core.loader import EMBEDDED_MODEL, embedded_gguf_path, resolve_model
    from kvforge.core.tokenizer import Tokenizer

    batches = int_list(args.batches, "batches")
    for name in ("prompts", "output_tokens", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    engines = _selected(args)
    quantized = str(resolve_model(args.kvforge_4bit)) if args.kvforge_4bit else None
    model_dir, gguf = resolve_model(None), embedded_gguf_path()  # vLLM reads kvforge's conversion of the GGUF
    threads = args.threads or len(usable_cpus())
    requests = requests_per_batch(args.prompts, batches)
    tokenizer = Tokenizer(model_dir)
    prompts = [tokenizer.apply_chat_template(m) for m in chat_messages(max(requests.values()))]
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
    common = {"prompts": prompts, "batches": batches, "requests": {str(b): n for b, n in requests.items()},
              "output_tokens": args.output_tokens, "threads": threads, "kv_cache_gib": args.kv_cache_gb,
              "pad_id": pad}

    runs = []
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-peers-") as tmp:
        for engine in engines:
            run = EngineRun(engine)
            runs.append(run)
            if engine.peer:
                run.python, why = find_peer(engine.peer, args)
                if why:
                    run.status, run.why = "skipped", why
                    _say(f"{engine.name}: skipped ({why})")
                    continue
            else:
                run.python = sys.executable
            model = {"vllm": str(model_dir), "llama.cpp": str(gguf)}.get(engine.kind, str(model_dir))
            if engine.name == "kvforge-4bit":
                model = quantized
            _say(f"{engine.name}: running ({run.python})")
            run_engine(run, {**common, "kind": engine.kind, "model": model, "dtype": engine.dtype}, Path(tmp),
                       args.timeout, env)
            _say(f"{engine.name}: {run.status} in {run.seconds:.0f} s" + (f" ({run.why})" if run.why else ""))

    report = {"command": "kvforge bench peers", "model": f"{EMBEDDED_MODEL} (the embedded model)", "cpu": cpu,
              "options": {"batches": batches, "prompts": args.prompts, "output_tokens": args.output_tokens,
                          "threads": threads, "kv_cache_gb": args.kv_cache_gb,
                          "vllm_cpus": vllm_cpus if any(r.engine.kind == "vllm" and r.status != "skipped"
                                                        for r in runs) else None},
              "prompts": {"count": len(prompts), "min_tokens": min(lengths), "max_tokens": max(lengths),
                          "mean_tokens": sum(lengths) / len(lengths)},
              "requests_per_batch": {str(b): n for b, n in requests.items()},
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
                      "each in its own process, same prompts and token counts")
    peers.add_argument("--engines", default=None,
                       help=f"comma-separated, from {', '.join(e.name for e in ENGINES)} (default: all; "
                            "kvforge-4bit only with --kvforge-4bit; a peer that is not installed is skipped)")
    peers.add_argument("--batches", default="1,16,64", help="requests submitted at once (default: 1,16,64)")
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
    peers.add_argument("--timeout", type=float, default=1800, help="seconds per engine (default: 1800)")
    peers.add_argument("--json", default=None, metavar="PATH", help="also write the whole report as JSON")
    peers.set_defaults(func=run_peers)
    return peers
