"""`kvforge bench peers`: kvforge side by side with other CPU engines on one GGUF, in one run: the embedded
model's Q4_1 GGUF, or --gguf FILE (e.g. Gemma 3 270M Q4_K_M).

Engines, each in a process of its own, one after another (peer_worker.py): HF transformers in fp32 (the
reference every ratio is taken against), kvforge in fp32 and bf16 (dense), kvforge-gguf (the GGUF itself, served
from its quantized blocks: the gguf plugin), a 4-bit checkpoint with --kvforge-4bit DIR, and, when their
virtualenvs are found, vLLM CPU in bf16 and fp32 and llama.cpp (llama-cpp-python on the GGUF itself). The dense
engines (HF, kvforge fp32 / bf16, vLLM) all read kvforge's safetensors conversion of the GGUF (the loader's,
cached), so every engine runs the same weights. A peer that is not installed is reported as skipped, with why;
an engine that fails is reported with the tail of its stderr, and the others still run.

Every engine gets the same token ids (the chat prompts of workloads.chat_messages with kvforge's chat
template applied), greedy, forced to --output-tokens tokens (EOS ignored), prefix caching off. At batch B
an engine serves ceil(--prompts / B) * B requests in waves of B submitted at once. Per engine and batch:
output tok/s, TTFT and TPOT (p50 / p99 over the requests) where the engine lets us measure them ("-" where
not), and the ratios against HF fp32, vLLM bf16 and llama.cpp measured in the same run. With --rounds N every
engine runs N times, the engines taking turns (A B A B ...), and each figure is the median over the rounds (the
ratios: medians of each round's own ratios, also listed). Before each engine its model's files are read once, so that
every engine starts with them in the page cache.

With --http the same engines run as OpenAI-compatible servers under a load generator (peers_http.py), on the
same files.

With --shape 1.7b|3b|8b|olmoe-1b-7b [--quant q4_0|q4_k_m|q8_0|f16] the engines run random-weight models of a real
model's shape (real_shapes.py, cached; olmoe-1b-7b a mixture of experts, llama.cpp's olmoe architecture): llama.cpp
and kvforge-gguf a GGUF of that shape and quantization, the dense engines (HF, vLLM, kvforge fp32 / bf16) its bf16
safetensors twin (random values of their own: speed and memory only, no multi-GB GGUF is converted). The default
engines are then kvforge-gguf, llama.cpp and vllm-bf16 (each a peer skipped where it is not installed; HF fp32 or
kvforge's dense engines on an 8B shape only when --engines names them), the default batches 1,16, prompts 4 and
output tokens 64. The report adds the machine's streaming-read bandwidth (roofline.py), the bytes of the GGUF a
decode step reads (of a MoE's experts the used ones) and their ratio, the roofline batch-1 decode rate, and per
engine its load time, memory after load and peak (the worker's process tree), batch-1 decode rate (1 / TPOT p50) as
a fraction of the roofline, and batch-16 throughput.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from kvforge.app.bench.arguments import int_list
from kvforge.app.bench.peer_engines import (
    ENGINES,
    SERVERS,
    STDERR_TAIL_LINES,
    Engine,
    EngineRun,
    add_peer_options,
    find_peer,
    last_lines,
    say,
    stop_group,
    usable_cpus,
    vllm_cpu_binding,
)
from kvforge.app.bench.peers_http import LLAMA_SERVER_MODULES, HttpSetup, choose_load_generator, run_http_engine
from kvforge.app.bench.peers_report import engine_summary, measurement_rows, median_rows, print_report
from kvforge.app.bench.workloads import chat_messages

WORKER = Path(__file__).with_name("peer_worker.py")


def warm_page_cache(model: Path) -> None:
    """Read the model's weight files once, so that every engine starts with them in the page cache (a file read
    from disk by the first engine only would charge it alone: a cold 1 GB GGUF took 14.8 s to load here, 1.7 s
    warm)."""
    files = [model] if model.is_file() else sorted(model.glob("*.safetensors")) if model.is_dir() else []
    for file in files:
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass


def requests_per_batch(prompts: int, batches: list[int]) -> dict[int, int]:
    """Whole waves: at batch B, ceil(prompts / B) * B requests."""
    return {b: math.ceil(prompts / b) * b for b in batches}


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
            stop_group(proc)
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
        run.stderr_tail = last_lines(err.read_text(errors="replace"), STDERR_TAIL_LINES)
    return run


def bench_gguf(args: argparse.Namespace) -> Path:
    """The GGUF every engine runs: --gguf FILE, else the embedded model's (absolute: the workers run elsewhere)."""
    from kvforge.core.loader import embedded_gguf_path

    if not args.gguf:
        return embedded_gguf_path()
    path = Path(args.gguf).expanduser().resolve()
    if not path.is_file() or path.suffix != ".gguf":
        raise ValueError(f"--gguf {args.gguf}: not a .gguf file")
    return path


SHAPE_ENGINES = ("kvforge-gguf", "llama.cpp", "vllm-bf16")  # --shape's default engines
SHAPE_DEFAULTS = {"batches": "1,16", "prompts": 4, "output_tokens": 64}  # --shape's defaults (else PLAIN_DEFAULTS)
PLAIN_DEFAULTS = {"batches": "1,16,64", "prompts": 16, "output_tokens": 128}
DENSE_KINDS = ("hf", "vllm", "kvforge")  # the engines that read a safetensors directory (but kvforge-gguf / -4bit)


def reads_safetensors(engine: Engine) -> bool:
    return engine.kind in DENSE_KINDS and engine.name not in ("kvforge-gguf", "kvforge-4bit")


def check_shape_options(args: argparse.Namespace):
    """--shape / --quant checked before anything loads; the Shape, or None without --shape. The defaults of
    --batches, --prompts and --output-tokens are filled in (--shape's smaller ones with it)."""
    shape = None
    if args.shape is not None:
        from kvforge.app.bench.real_shapes import check_quant, get_shape

        shape = get_shape(args.shape)
        if args.gguf:
            raise ValueError("--shape and --gguf: choose one (--shape writes its own GGUF)")
        args.quant = check_quant(args.quant or "q4_0")
    elif args.quant is not None:
        raise ValueError("--quant is for --shape (a --gguf file has its own quantization)")
    for name, value in (SHAPE_DEFAULTS if shape else PLAIN_DEFAULTS).items():
        if name == "batches" and args.http:
            continue  # --http takes --concurrency
        if getattr(args, name) is None:
            setattr(args, name, value)
    return shape


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
    elif getattr(args, "shape", None):  # --shape's defaults
        wanted = list(SHAPE_ENGINES) + (["kvforge-4bit"] if args.kvforge_4bit else [])
    else:
        wanted = [n for n in names if (n != "kvforge-4bit" or args.kvforge_4bit)
                  and (not args.http or kinds[n] in SERVERS)]
    if args.http:
        serverless = [n for n in wanted if kinds[n] not in SERVERS]
        if serverless:
            raise ValueError(f"--engines {serverless[0]}: no server to run with --http")
    return [e for e in ENGINES if e.name in wanted]


# --- the command ------------------------------------------------------------------------------------------------

def run_peers(args: argparse.Namespace) -> int:
    from kvforge.app.bench.roofline import cpu_identity
    from kvforge.app.models.catalog import gguf_facts
    from kvforge.core.cpu import cpu_model_and_flags, isa
    from kvforge.core.loader import EMBEDDED_MODEL, resolve_model
    from kvforge.core.tokenizer import Tokenizer

    shape = check_shape_options(args)
    if args.http and args.batches is not None:
        raise ValueError("--batches is for the offline engines: with --http use --concurrency")
    if not args.http and args.concurrency is not None:
        raise ValueError("--concurrency is for --http (the offline engines take --batches)")
    batches = (int_list(args.concurrency or "1,16,64", "concurrency") if args.http
               else int_list(args.batches, "batches"))
    for name in ("prompts", "output_tokens", "threads", "input_tokens", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    selected = _selected(args)
    threads = args.threads or len(usable_cpus())
    shape_info, twin = None, {}
    if shape:
        from kvforge.app.bench.real_shapes import shape_gguf
        from kvforge.app.bench.roofline import decode_bytes, roofline_tok_s, stream_bandwidth

        gguf = shape_gguf(shape, args.quant, log=say)
        say(f"measuring the streaming-read bandwidth ({threads} thread{'s' if threads > 1 else ''})")
        bandwidth = stream_bandwidth(threads)
        step = decode_bytes(gguf)
        shape_info = {"shape": shape.name, "description": shape.describe(), "quant": args.quant, "gguf": str(gguf),
                      "gguf_bytes": gguf.stat().st_size, "twin": None, "bandwidth": bandwidth, "decode_step": step,
                      "roofline_tok_s": roofline_tok_s(bandwidth["bytes_per_s"], step["bytes"])}
    else:
        gguf = bench_gguf(args)
    # llama.cpp runs the file as it is; its type from the header alone (GGUFReader walks a 262k-token vocabulary
    # into numpy views: ~20 s for Gemma 3's, ~5 s for the embedded model's)
    file_type = (gguf_facts(gguf).quantization or "gguf").lower()
    engines = [replace(e, dtype=file_type) if e.kind == "llama.cpp" else e for e in selected]
    quantized = str(resolve_model(args.kvforge_4bit)) if args.kvforge_4bit else None
    # the dense engines read kvforge's conversion of the GGUF; with --shape the twin, written when one runs (below),
    # and the prompts come from the embedded model's tokenizer (the GGUF's)
    model_dir = resolve_model(None if shape else str(gguf))
    requests = requests_per_batch(args.prompts, batches)
    tokenizer = Tokenizer(model_dir)
    messages = chat_messages(max(requests.values()))
    prompts = [tokenizer.apply_chat_template(m) for m in messages]
    lengths = [len(ids) for ids in prompts]
    hf_tok = tokenizer.hf
    pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id

    cpu_model, _ = cpu_model_and_flags()
    cpu = {"model": cpu_model, "machine": os.uname().machine, "isa": isa(), "logical_cpus": os.cpu_count(),
           "usable_cpus": len(usable_cpus()), "threads": threads} | cpu_identity()
    vllm_cpus = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or vllm_cpu_binding(threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1",
               VLLM_CPU_OMP_THREADS_BIND=vllm_cpus, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    models = {e.name: {"vllm": str(model_dir), "llama.cpp": str(gguf)}.get(e.kind, str(model_dir)) for e in ENGINES}
    models["kvforge-gguf"] = str(gguf)  # the file llama.cpp runs, served from its own quantized blocks
    if quantized:
        models["kvforge-4bit"] = quantized

    def model_of(engine: Engine) -> str:
        """The engine's model; with --shape the twin for those that read safetensors, written on first use."""
        if shape and reads_safetensors(engine):
            if "dir" not in twin:
                from kvforge.app.bench.shape_twin import shape_twin

                twin["dir"] = str(shape_twin(shape, tokenizer_dir=model_dir, log=say))
                shape_info["twin"] = twin["dir"]
            return twin["dir"]
        return models[engine.name]

    setup, needs = None, {}  # needs: the modules a peer's server needs besides the peer's own
    if args.http:
        needs = {"llama": LLAMA_SERVER_MODULES}
        generator = choose_load_generator(args)
        longest = max(max(lengths), args.input_tokens + 64)  # + the chat template around a random prompt
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(args.kv_cache_gb))))
        setup = HttpSetup(args, batches, requests, messages, generator, {**models, "tokenizer": str(model_dir)},
                          threads, max(2048, longest + args.output_tokens + 16), env)
        say(f"load generator: {generator.description}" + (f" ({generator.why})" if generator.why else ""))
    common = {"prompts": prompts, "batches": batches, "requests": {str(b): n for b, n in requests.items()},
              "output_tokens": args.output_tokens, "threads": threads, "kv_cache_gib": args.kv_cache_gb,
              "pad_id": pad}

    rounds: list[list[EngineRun]] = []  # each round runs every engine once, in the same order
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-peers-") as tmp:
        for number in range(1, args.rounds + 1):
            runs = []
            rounds.append(runs)
            for engine in engines:
                run = EngineRun(engine)
                runs.append(run)
                name = engine.name + (f" (round {number})" if args.rounds > 1 else "")
                if engine.peer:
                    run.python, why = find_peer(engine.peer, args, needs.get(engine.peer, ()))
                    if why:
                        run.status, run.why = "skipped", why
                        say(f"{name}: skipped ({why})")
                        continue
                else:
                    run.python = sys.executable
                say(f"{name}: running ({run.python})")
                model = model_of(engine)
                warm_page_cache(Path(model))
                if setup:
                    setup.models[engine.name] = model
                    run_http_engine(run, setup, Path(tmp))
                else:
                    run_engine(run, {**common, "kind": engine.kind, "model": model, "dtype": engine.dtype}, Path(tmp),
                               args.timeout, env)
                say(f"{name}: {run.status} in {run.seconds:.0f} s" + (f" ({run.why})" if run.why else ""))

    every_run = [run for runs in rounds for run in runs]
    options = {"batches": batches, "prompts": args.prompts, "output_tokens": args.output_tokens, "threads": threads,
               "kv_cache_gb": args.kv_cache_gb, "rounds": args.rounds,
               "vllm_cpus": vllm_cpus if any(r.engine.kind == "vllm" and r.status != "skipped" for r in every_run)
               else None}
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
    if shape:
        model = f"random-weight {args.quant.upper()} GGUF of the {shape.body} shape ({gguf})"
    else:
        model = str(gguf) if args.gguf else f"{EMBEDDED_MODEL} (the embedded model)"
    command = "kvforge bench peers" + (" --http" if setup else "") + (f" --shape {shape.name} --quant {args.quant}"
                                                                       if shape else "")
    rows = median_rows([measurement_rows(runs, args.output_tokens, lengths) for runs in rounds])
    report = {"command": command, "model": model, "cpu": cpu, "options": options, "prompts": prompt_info,
              "requests_per_batch": {str(b): n for b, n in requests.items()},
              "engines": [r.summary() | {"round": number} for number, runs in enumerate(rounds, 1) for r in runs],
              "rows": rows, "shape": shape_info,
              "summary": engine_summary(rounds, rows, shape_info["roofline_tok_s"] if shape_info else None)}
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if any(r.status == "failed" for r in every_run) else 0


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register `peers` on the `kvforge bench` subcommands."""
    peers = bench_sub.add_parser(
        "peers", help="kvforge side by side with HF transformers, vLLM CPU and llama.cpp (when installed), "
                      "each in its own process, same prompts and token counts (--http: their servers under load)")
    peers.add_argument("--engines", default=None,
                       help=f"comma-separated, from {', '.join(e.name for e in ENGINES)} (default: all; "
                            "kvforge-4bit only with --kvforge-4bit; hf-fp32 not with --http; with --shape "
                            f"{', '.join(SHAPE_ENGINES)}; a peer that is not installed is skipped)")
    peers.add_argument("--batches", default=None,
                       help="requests submitted at once (default: 1,16,64; with --shape 1,16)")
    peers.add_argument("--prompts", type=int, default=None,
                       help="chat prompts per batch: at batch B, ceil(N / B) * B requests (default: 16; with "
                            "--shape 4)")
    peers.add_argument("--output-tokens", type=int, default=None,
                       help="tokens per request, EOS ignored (default: 128; with --shape 64)")
    peers.add_argument("--threads", type=int, default=None, help="CPU threads per engine (default: the usable CPUs)")
    peers.add_argument("--kv-cache-gb", type=float, default=2.0,
                       help="KV cache of kvforge and vLLM (VLLM_CPU_KVCACHE_SPACE) in GiB (default: 2)")
    peers.add_argument("--gguf", default=None, metavar="FILE",
                       help="the GGUF to compare on (default: the embedded model's): llama.cpp and kvforge-gguf run "
                            "the file, the dense engines kvforge's safetensors conversion of it")
    peers.add_argument("--shape", default=None, metavar="SHAPE",
                       help="run on random-weight models of a real shape instead: 1.7b (SmolLM2-1.7B), 3b "
                            "(Llama-3.2-3B), 8b (Llama-3-8B), olmoe-1b-7b (OLMoE-1B-7B: 64 experts, 8 a token), tiny, "
                            "tiny-moe (smoke tests), each with the embedded 49152-token "
                            "vocabulary: a GGUF for llama.cpp and kvforge-gguf, a bf16 safetensors twin for the dense "
                            "engines (written once into the cache dir's bench_shapes/); default engines kvforge-gguf, "
                            "llama.cpp, vllm-bf16; adds the memory bandwidth, the roofline and memory per engine")
    peers.add_argument("--quant", default=None, metavar="QUANT",
                       help="--shape's GGUF quantization: q4_0 (default), q4_k_m, q8_0, f16")
    peers.add_argument("--kvforge-4bit", default=None, metavar="DIR",
                       help="also kvforge on this 4-bit GPTQ / AWQ checkpoint in bf16 (e.g. from `kvforge quantize`)")
    add_peer_options(peers, ("vllm", "llama"), "HF and kvforge only: skip vLLM and llama.cpp")
    peers.add_argument("--rounds", type=int, default=1,
                       help="run every engine this many times, one after another in turn, and report the medians "
                            "(on a shared machine runs minutes apart differ by 10-30%%; default: 1)")
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
